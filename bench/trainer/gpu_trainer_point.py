"""One backend's points of bench/trainer/gpu_trainer.py, in a process of its own.

    python -m bench.trainer.gpu_trainer_point --prepare DIR --spec SPEC.json   # the random checkpoint
    python -m bench.trainer.gpu_trainer_point --spec SPEC.json                 # the points, one line each

The backend is built once (model, optimiser) and every point reuses it: the head kernel
(`trainer.logprob_kernel`), the attention kernel, the recompute mode and finally compile are
switched in place between points, on the objects the backend built: HF gradient checkpointing
on/off; Megatron's TransformerConfig recompute fields and the attention modules'
`checkpoint_core_attention`, which its forward reads at run time (the same code paths a model
built with that mode takes). Per point: one warm-up step (compiles, autotuning, Adam state), then
the caching allocator is emptied and its peaks reset, and two timed steps of one packed
micro-batch (the step time is the last one's: the first pays the emptied allocator's cudaMalloc
calls; the peaks are over both). Prints `POINT {json}` per point as it ends (the parent keeps what a killed process
printed), or `SKIP {json}` once the deadline is too near for the next point.

On CPU (the smoke) memory is the process's peak RSS above its baseline before the model existed,
as bench/trainer/trainer_memory_point.py measures it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def log(message: str) -> None:
    print(f"[gpu_trainer] {message}", file=sys.stderr, flush=True)


def prepare(model_dir: Path, spec: dict) -> dict:
    """A checkpoint of the shape's family (Qwen2, or Qwen3-MoE: Qwen3MoeForCausalLM) with random
    weights in the bench dtype (built on the GPU when there is one: seconds for 1.8B parameters),
    and what the device is."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in spec["config"].items() if k not in ("model_type", "architectures")}
    config = AutoConfig.for_model(
        spec["config"]["model_type"], **cfg, max_position_embeddings=65536, rope_theta=1e6
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    model.to(getattr(torch, spec["dtype"])).save_pretrained(str(model_dir))
    del model
    return device_info()


def device_info() -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        name, memory = props.name, props.total_memory
    else:
        name, memory = "cpu", 0
    return {"name": name, "memory_bytes": memory, "torch": torch.__version__, "triton": triton_version}


def make_batch(lengths: list[int], vocab: int, seed: int):
    from areal_jobs.trainer.intake.batch import TrainBatch, TrainSample
    from bench.trainer.gpu_trainer_report import prompt_tokens

    rng = np.random.default_rng(seed)
    samples = []
    for i, n in enumerate(lengths):
        p = prompt_tokens(n)
        samples.append(
            TrainSample(
                f"s{i}", rng.integers(1, vocab, n).astype(np.int64), p,
                np.full(n - p, -float(np.log(vocab)), np.float32), np.zeros(n - p, np.int32),
                float(rng.choice([-1.0, 1.0])), 0.0,
            )
        )  # fmt: skip
    return TrainBatch(version=0, samples=samples, group_ids=["g"])


def build(spec: dict):
    """(backend, memory): the backend set up; the memory baseline taken after its imports and
    before its model exists."""
    import torch

    from areal_jobs.config import AlgoConfig, DType, TrainerBackend, TrainerConfig

    on_gpu = torch.cuda.is_available()
    trainer = TrainerConfig(
        backend=TrainerBackend(spec["backend"]), lr=1e-6, threads=spec["threads"],
        max_tokens_per_microbatch=max(p["tokens"] for p in spec["points"]),
    )  # fmt: skip
    dtype, model_dir = DType(spec["dtype"]), spec["model_dir"]
    if spec["backend"] == "megatron":
        from areal_jobs.trainer.megatron.backend import MegatronBackend

        backend = MegatronBackend(trainer, AlgoConfig(), model_dir, dtype)
    else:
        from areal_jobs.trainer.torch.backend import TorchBackend

        backend = TorchBackend(trainer, AlgoConfig(), model_dir, dtype, device="cuda" if on_gpu else None)
    memory = Memory()
    backend.setup()
    return backend, memory


def configure(backend, kind: str, point: dict) -> None:
    """Switch the built backend to the point's head, attention, recompute and compile."""
    from areal_jobs.config import Attention, Recompute
    from areal_jobs.trainer.forward.layer_compile import (
        compile_layers,
        hf_decoder_layers,
        megatron_decoder_layers,
    )
    from areal_jobs.trainer.forward.packed_attention import check_attention_device

    attention = Attention(point["attention"])
    if kind == "megatron":
        from areal_jobs.trainer.megatron.attention import PackedCoreAttention
        from areal_jobs.trainer.megatron.model import recompute_settings

        check_attention_device(attention.value, backend._device)
        backend._cfg.max_tokens_per_microbatch = point["tokens"]
        backend._head.kernel = point["head"]
        gpt = backend._gpt
        settings = {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}
        settings.update(recompute_settings(Recompute(point["recompute"])))
        for key, value in settings.items():
            setattr(gpt.config, key, value)
        for module in gpt.modules():
            if isinstance(module, PackedCoreAttention):
                module.kind = attention
            if hasattr(module, "checkpoint_core_attention"):
                module.checkpoint_core_attention = point["recompute"] == "selective"
        layers = megatron_decoder_layers(gpt)
    else:
        from areal_jobs.trainer.forward.attention import HF_NAMES

        check_attention_device(attention.value, backend.device)
        backend.cfg.max_tokens_per_microbatch = point["tokens"]
        backend.kernel = point["head"]
        backend.model.config._attn_implementation = HF_NAMES[attention]
        if point["recompute"] == "full":
            backend.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            backend.model.gradient_checkpointing_disable()
        layers = hf_decoder_layers(backend.model)
    if point["compile"] and not getattr(backend, "_bench_compiled", False):
        compile_layers(layers)
        backend._bench_compiled = True


class Memory:
    """Peak memory of the timed steps: the CUDA caching allocator's, or on CPU the process's RSS."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda.is_available()
        if not self.cuda:
            from bench.trainer.trainer_memory_point import rss_bytes

            self.baseline = rss_bytes()

    def reset(self) -> None:
        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        else:
            from bench.trainer.trainer_memory_point import reset_peak_rss

            reset_peak_rss()

    def read(self) -> dict:
        import torch

        if not self.cuda:
            from bench.trainer.trainer_memory_point import peak_rss_bytes

            peak = peak_rss_bytes() - self.baseline
            return {"peak_allocated_bytes": peak, "peak_reserved_bytes": peak, "outside_allocator_bytes": 0}
        free, total = torch.cuda.mem_get_info()
        return {
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
            "outside_allocator_bytes": (total - free) - torch.cuda.memory_reserved(),
        }


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_point(backend, point: dict, memory: Memory, spec: dict) -> dict:
    import torch

    batch = make_batch(point["lengths"], spec["config"]["vocab_size"], seed=point["tokens"])
    backend.train_step(batch)  # warm-up: compiles, autotuning; gradients and Adam state exist
    sync()
    memory.reset()
    times, losses = [], []
    for _ in range(spec["timed_steps"]):
        t0 = time.perf_counter()
        metrics = backend.train_step(batch)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(metrics["train/loss"]))
    if not all(np.isfinite(losses)):
        raise FloatingPointError(f"non-finite loss {losses}")
    # the last step: the first after the allocator was emptied pays its cudaMalloc calls again
    step_s = times[-1]
    del batch
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"status": "ok", "step_s": step_s, "step_times_s": times, "loss": losses[-1], **memory.read()}


def first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:240]


def best_after_attention(rows: list[dict], tokens: int) -> str:
    """The fastest attention of the Triton-head points at the largest size (full recompute)."""
    done = [r for r in rows if r["status"] == "ok" and r["tokens"] == tokens and r["head"] == "triton"]
    done = [r for r in done if r["recompute"] == "full" and not r["compile"]]
    return min(done, key=lambda r: r["step_s"])["attention"] if done else "flex"


def run_points(spec: dict) -> None:
    import torch

    torch.manual_seed(0)
    if not torch.cuda.is_available():
        torch.set_num_threads(spec["threads"])
    started = time.time()
    backend, memory = build(spec)
    log(f"{spec['backend']}: built in {time.time() - started:.0f} s")
    rows: list[dict] = []
    ratios: list[float] = []  # measured / estimated time of the points so far: scales the next estimates
    for point in spec["points"]:
        if point["compile"] and point["attention"] == "best":
            point = {**point, "attention": best_after_attention(rows, point["tokens"])}
        slowdown = min(4.0, max(0.5, statistics.median(ratios))) if ratios else 1.0
        estimate = point["estimate_s"] * slowdown
        if time.time() + estimate > spec["deadline"]:
            print(
                "SKIP " + json.dumps({**point, "status": f"skipped: budget (~{estimate:.0f} s left needed)"}),
                flush=True,
            )
            continue
        t0 = time.time()
        try:
            configure(backend, spec["backend"], point)
        except ValueError as exc:  # a kind this device does not run, refused by name
            result = {"status": f"refused: {first_line(exc)}"}
        else:
            try:
                result = run_point(backend, point, memory, spec)
            except torch.cuda.OutOfMemoryError as exc:
                result = {"status": "oom", **memory.read(), "error": first_line(exc)}
            except Exception as exc:  # noqa: BLE001 - recorded in the table; the next point still runs
                result = {"status": f"error: {type(exc).__name__}: {first_line(exc)}"}
        result["wall_s"] = time.time() - t0
        if result["status"] == "ok":
            ratios.append(result["wall_s"] / max(point["estimate_s"], 1e-3))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        row = {**point, **result}
        rows.append(row)
        log(f"{point['name']}: {row['status']} in {row['wall_s']:.1f} s")
        print("POINT " + json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trainer.gpu_trainer_point")
    parser.add_argument("--spec", required=True, type=Path)
    parser.add_argument("--prepare", type=Path, help="write the random checkpoint here and print the device")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    if args.prepare:
        print("DEVICE " + json.dumps(prepare(args.prepare, spec)), flush=True)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", str(spec["threads"]))
    run_points(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
