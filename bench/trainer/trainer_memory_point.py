"""One point of the trainer_memory bench, in a fresh process: peak memory and speed of one step.

    python -m bench.trainer.trainer_memory_point --backend torch --tokens 8192 --model DIR [--set key=value ...]

Prints one JSON object. The process first builds and steps a throwaway 1-layer model of the same
architecture on the same backend, so every module the backend imports lazily is loaded, frees it
and records its resident set (the baseline); then it builds the backend, takes a small warm-up step
(gradients and Adam state exist from then on, as in every later step of a run), resets the
kernel's peak-RSS mark (`/proc/self/clear_refs`), and takes one step of `--tokens` tokens in one
micro-batch. Peak = VmHWM - baseline: everything the model, its optimiser and the step hold at the
worst moment. The bench runs this process with glibc's mmap threshold fixed at 64 KiB
(MALLOC_MMAP_THRESHOLD_), so every tensor's memory returns to the kernel when it is freed and RSS
follows the live tensors (otherwise the heap keeps what it reused and fragmented).
During the measured step a dispatch mode records the largest tensors created (shape, dtype,
bytes), which shows whether a [T, V] or [T, T] tensor exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

SEQUENCE_TOKENS = 1024  # each packed sequence: a 64-token prompt and a 960-token answer
PROMPT_TOKENS = 64
WARMUP_TOKENS = 128


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Return the heap's free memory to the kernel (glibc keeps what setup and the warm-up freed),
    then reset VmHWM to the current RSS (Linux: 5 > /proc/self/clear_refs)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def make_batch(tokens: int, vocab: int, seed: int = 0):
    """Sequences of SEQUENCE_TOKENS (the last one shorter) filling exactly `tokens` tokens."""
    import numpy as np

    from areal_jobs.trainer.intake.batch import TrainBatch, TrainSample

    rng = np.random.default_rng(seed)
    lengths = [SEQUENCE_TOKENS] * (tokens // SEQUENCE_TOKENS)
    if tokens % SEQUENCE_TOKENS:
        lengths.append(tokens % SEQUENCE_TOKENS)
    samples = []
    for i, n in enumerate(lengths):
        prompt = min(PROMPT_TOKENS, n // 2)
        out = n - prompt
        samples.append(
            TrainSample(
                sample_id=f"s{i}",
                input_ids=rng.integers(1, vocab, size=n).astype(np.int64),
                num_prompt_tokens=prompt,
                behav_logprobs=np.full(out, -float(np.log(vocab)), dtype=np.float32),
                versions=np.zeros(out, dtype=np.int32),
                advantage=float(rng.choice([-1.0, 1.0])),
                reward=0.0,
            )
        )
    return TrainBatch(version=0, samples=samples, group_ids=["g"])


class LargestTensors:
    """A dispatch mode that keeps the largest storages created by any op: (bytes, shape, dtype)."""

    def __init__(self, keep: int = 4) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer.record(out)
                return out

        self.mode = Mode()
        self.keep = keep
        self.seen: dict[tuple, int] = {}

    def record(self, out) -> None:
        import torch

        items = out if isinstance(out, (tuple, list)) else (out,)
        for t in items:
            # a view allocates nothing: only tensors that own their storage count
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t._is_view():
                nbytes = t.numel() * t.element_size()
                key = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
                if nbytes > self.seen.get(key, 0):
                    self.seen[key] = nbytes

    def top(self) -> list[dict]:
        ranked = sorted(self.seen.items(), key=lambda kv: -kv[1])[: self.keep]
        return [{"shape": list(k[0]), "dtype": k[1], "bytes": v} for k, v in ranked]


def build_backend(kind: str, model_dir: str, tokens: int, overrides: dict):
    from areal_jobs.config import AlgoConfig, DType, TrainerBackend, TrainerConfig

    trainer = TrainerConfig(
        backend=TrainerBackend(kind), lr=1e-5, max_tokens_per_microbatch=tokens, threads=1
    )
    trainer = dataclasses.replace(trainer, **_typed(trainer, overrides))
    if kind == "megatron":
        from areal_jobs.trainer.megatron.backend import MegatronBackend as Backend
    elif kind == "fsdp":
        from areal_jobs.trainer.fsdp.backend import FSDPBackend as Backend
    else:
        from areal_jobs.trainer.torch.backend import TorchBackend as Backend
    return trainer, Backend(trainer, AlgoConfig(), model_dir, DType.float32)


def _typed(trainer, overrides: dict) -> dict:
    """`key=value` strings -> the TrainerConfig field's type (an Enum, int or bool)."""
    import enum

    out = {}
    for key, text in overrides.items():
        current = getattr(trainer, key)
        if isinstance(current, enum.Enum):
            out[key] = type(current)(text)
        elif isinstance(current, bool):
            out[key] = text.lower() in ("1", "true", "yes")
        else:
            out[key] = type(current)(text)
    return out


def warm_up_imports(kind: str, model_dir: str, tokens: int, overrides: dict) -> None:
    """Set up and step a 1-layer, 64-token-vocabulary copy of the model on the same backend, then
    free it: what the backend imports on first use belongs to the process, not to the step."""
    import gc
    import tempfile

    config = json.loads((Path(model_dir) / "config.json").read_text())
    config.update(num_hidden_layers=1, vocab_size=64, hidden_size=32, intermediate_size=64)
    config.pop("layer_types", None)
    with tempfile.TemporaryDirectory(prefix="warm_") as tmp:
        from transformers import AutoConfig, AutoModelForCausalLM

        AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).save_pretrained(tmp)
        _, backend = build_backend(kind, tmp, tokens, overrides)
        backend.setup()
        backend.train_step(make_batch(WARMUP_TOKENS, 64, seed=2))
        del backend
    gc.collect()


def measure(kind: str, model_dir: str, tokens: int, overrides: dict, threads: int) -> dict:
    import ctypes
    import gc

    import torch

    torch.set_num_threads(threads)
    warm_up_imports(kind, model_dir, tokens, overrides)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    baseline = rss_bytes()
    trainer, backend = build_backend(kind, model_dir, tokens, overrides)
    backend.setup()
    backend.train_step(make_batch(WARMUP_TOKENS, vocab, seed=1))  # gradients + Adam state exist now
    batch = make_batch(tokens, vocab)
    largest = LargestTensors()
    reset_peak_rss()
    start_rss = rss_bytes()
    t0 = time.perf_counter()
    with largest.mode:
        metrics = backend.train_step(batch)
    step_s = time.perf_counter() - t0
    peak = peak_rss_bytes()
    return {
        "backend": kind,
        "tokens": tokens,
        "overrides": overrides,
        "baseline_rss_bytes": baseline,
        "step_start_rss_bytes": start_rss,
        "peak_bytes": peak - baseline,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "loss": float(metrics.get("train/loss", float("nan"))),
        "num_microbatches": float(metrics.get("train/num_microbatches", 0)),
        "largest": largest.top(),
        "trainer": {k: str(v) for k, v in dataclasses.asdict(trainer).items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trainer.trainer_memory_point")
    parser.add_argument("--backend", required=True, choices=("torch", "megatron", "fsdp"))
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="trainer.<key>=<value> override")
    args = parser.parse_args(argv)
    overrides = dict(item.removeprefix("trainer.").split("=", 1) for item in args.set)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    result = measure(args.backend, args.model, args.tokens, overrides, args.threads)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
