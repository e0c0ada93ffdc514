"""SGLang vs vLLM on this machine: generation tokens/s and weight-update seconds, same model (the
bench model), same load, same run, one engine at a time. Under `make bench` SGLang is the server the other
sections share (same model, threads and token budget as one started here), then vLLM is started,
measured and stopped; on its own the section starts and stops each engine.

- generation: `num_requests` concurrent requests of the built-in task's prompts at temperature 1,
  `max_new_tokens` each, through the engine's client (api.RolloutEngineClient); tokens/s = every
  generated token / wall time of the batch. One warm-up batch first (a server's first requests
  are slow), then `rounds` timed batches, median reported.
- weight update: the real handshake (WeightUpdateOrchestrator, abort mode, generation idle) with
  the trainer's WeightBroadcastGroup in a thread sending the bench model's weights over gloo as
  one bucket; the first update also forms the group and is not timed; median of the rest.

Both servers get 2 torch threads. Rows: engine/<sglang|vllm>_gen_tokens_per_s,
engine/<..>_update_s and the ratios engine/vllm_over_sglang_gen, engine/vllm_over_sglang_update.

Run: `python -m bench.rollout.engine_bench [--quick]`.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from areal_jobs.api import GenerateRequest, TensorSpec, WeightSender
from areal_jobs.config import DataConfig, ModelConfig, PauseMode, RolloutConfig, RolloutEngine
from areal_jobs.data.prompts import eval_prompts
from areal_jobs.data.tokenizer import load_tokenizer
from areal_jobs.rollout.engines import make_client
from areal_jobs.rollout.server import ServerProcess, start_server
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.rollout.weight_update import WeightUpdateOrchestrator
from areal_jobs.transport.discovery import free_port
from areal_jobs.weights.broadcast import WeightBroadcastGroup
from areal_jobs.weights.buckets import plan_buckets
from bench.harness import SharedServer, bench_model, model_weights

TIMEOUT_S = 300.0
SERVER_THREADS = 2  # as the shared server of `make bench` (bench/__main__.py)


async def generation_tokens_per_s(client, inputs: list[list[int]], max_new_tokens: int, tag: str) -> float:
    t0 = time.monotonic()
    responses = await asyncio.gather(
        *(
            client.generate(GenerateRequest(f"{tag}-{i}-{secrets.token_hex(3)}", ids, max_new_tokens, 1.0))
            for i, ids in enumerate(inputs)
        )
    )
    return sum(len(r.output_ids) for r in responses) / (time.monotonic() - t0)


async def update_seconds(client, weights: dict, updates: int) -> list[float]:
    pool = ServerPool()
    pool.add(0, client)
    orch = WeightUpdateOrchestrator(pool, PauseMode.abort, TIMEOUT_S)
    port = free_port()
    group = WeightBroadcastGroup(f"bench-engine-{port}", "127.0.0.1", port, "gloo", TIMEOUT_S)
    specs = [TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in weights.items()]
    buckets = tuple(plan_buckets(specs, 1 << 30))
    sender = WeightSender(group.base_name, "127.0.0.1", port, buckets)
    times = []
    try:
        for version in range(1, updates + 2):
            t0 = time.monotonic()
            await orch.pause(lambda: 0)
            init = orch.needs_group_init((sender,))
            generation = orch.next_generation() if init else orch.generation
            errors: list[BaseException] = []

            def trainer_side(init=init, generation=generation, errors=errors) -> None:
                try:
                    if init:
                        group.init(pool.group_world_size(), generation)
                    for b in buckets:
                        group.send_bucket(b, [weights[t.name] for t in b.tensors], f"bench bucket {b.index}")
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    errors.append(exc)

            thread = threading.Thread(target=trainer_side, daemon=True)
            thread.start()
            if init:
                await orch.init_groups((sender,), "gloo")
            await orch.receive(version, (sender,))
            await asyncio.get_running_loop().run_in_executor(None, thread.join, TIMEOUT_S)
            if errors:
                raise errors[0]
            await orch.resume()
            if version > 1:  # the first update also formed the group
                times.append(time.monotonic() - t0)
    finally:
        group.destroy()
    return times


def measure_engine(
    engine: RolloutEngine,
    model_dir: Path,
    log_dir: Path,
    quick: bool,
    server: ServerProcess | None = None,
    weight_dtype: str | None = None,
) -> dict[str, float]:
    """One engine's figures, on `server` (already healthy, left running) or on one started here
    (SERVER_THREADS threads, stopped at the end). `weight_dtype`: what the server holds where it is
    not the checkpoint's dtype, so what the updates send (a trainer ships a bf16 server the rounded
    copy); None: the checkpoint's tensors as stored."""
    num_requests, max_new, rounds, updates = (4, 32, 1, 2) if quick else (16, 128, 3, 5)
    own = server is None
    if own:
        rollout = RolloutConfig(
            engine=engine, server_threads=SERVER_THREADS, max_total_tokens=65536, kv_cache_gib=1.0
        )
        server = start_server(
            str(model_dir), "127.0.0.1", free_port(), secrets.token_hex(8), rollout, ModelConfig(),
            log_dir / f"{engine.value}.log",
        )  # fmt: skip
    tok = load_tokenizer(str(model_dir))
    inputs = [p.input_ids for p in eval_prompts(DataConfig(num_eval_prompts=num_requests), tok.encode)]
    weights = model_weights(model_dir)
    if weight_dtype is not None:
        weights = {n: t.to(getattr(torch, weight_dtype)) for n, t in weights.items()}

    async def body() -> dict[str, float]:
        client = make_client(
            engine, "0", server.url, server.api_key, generate_timeout_s=600, call_timeout_s=TIMEOUT_S
        )
        try:
            await generation_tokens_per_s(client, inputs, max_new, "warmup")
            rates = [await generation_tokens_per_s(client, inputs, max_new, f"r{i}") for i in range(rounds)]
            updates_s = await update_seconds(client, weights, updates)
        finally:
            await client.close()
        name = engine.value
        return {
            f"engine/{name}_gen_tokens_per_s": statistics.median(rates),
            f"engine/{name}_update_s": statistics.median(updates_s),
        }

    try:
        if own:
            server.wait_healthy(timeout_s=600)
        return asyncio.run(body())
    finally:
        if own:
            server.stop()


def run(
    quick: bool = False, server: ServerProcess | None = None, vllm: SharedServer | None = None
) -> dict[str, float]:
    """`server`: the SGLang server `make bench` shares between sections (the bench model,
    SERVER_THREADS threads, idle): measured as it is instead of starting a second one.
    `vllm`: the bf16 vLLM server (SERVER_THREADS threads) `make bench --quick` shares with the
    weight_delta section, one vLLM start fewer in the smoke run; its figures are then bf16 vLLM
    beside float32 SGLang (a smoke check, not a measurement). The full bench starts a vLLM server
    here, float32 as the SGLang one."""
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        results.update(measure_engine(RolloutEngine.sglang, bench_model(), Path(tmp), quick, server))
        # then vLLM, on its own server; the shared SGLang one, if any, sleeps meanwhile (--sleep-on-idle)
        shared, dtype = (vllm.get(), "bfloat16") if vllm is not None else (None, None)
        results.update(measure_engine(RolloutEngine.vllm, bench_model(), Path(tmp), quick, shared, dtype))
    results["engine/vllm_over_sglang_gen"] = (
        results["engine/vllm_gen_tokens_per_s"] / results["engine/sglang_gen_tokens_per_s"]
    )
    results["engine/vllm_over_sglang_update"] = (
        results["engine/vllm_update_s"] / results["engine/sglang_update_s"]
    )
    return results


if __name__ == "__main__":
    for key, value in run(quick="--quick" in sys.argv).items():
        print(f"{key}: {value:.3f}")
