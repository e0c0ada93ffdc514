"""Trainer memory and speed per micro-batch size at the real vocabulary, before and after (issue 25).

One training step of one packed micro-batch of 2,048 / 8,192 / 32,768 tokens (and 4,096 for
"before", whose 8k points do not fit this machine), in sequences of 1,024 tokens (a 64-token
prompt and a 960-token answer), through a Qwen2 of width 64, 2 layers and Qwen2's
151,936-token vocabulary, on CPU in float32, for the torch, Megatron and FSDP2 (one rank) backends:
  before  trainer.logprob_chunk_tokens=0 trainer.attention=dense trainer.recompute=none
  after   the defaults (log-probs in chunks of 1,024 tokens, per-sequence attention)
Each point runs in a fresh process (bench/trainer/trainer_memory_point.py): peak RSS above the process's
baseline (after imports, before the model exists), the step's tokens/s, and the largest tensors
the step created. Beside each peak: the memory model's prediction (launch/planning/fit/memory.py,
the same function the planner uses) and their ratio. A "before" point the model predicts above
SKIP_ABOVE_BYTES (this machine has 24 GiB) is not run and is reported as skipped; so is any point
the machine's available memory cannot hold right now.

The slope of the "after" curve (bytes per token between its two largest points) is reported, and
whether any step allocated a float32 tensor of [T, V] or [T, T] elements.

Run: `python -m bench.trainer.trainer_memory_bench [--quick]` or `python -m bench --only trainer_memory`.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from areal_jobs.config import TrainerBackend
from bench.harness import held_flock
from launch.planning.fit.memory import GIB, TrainerMemoryInputs, trainer_memory
from launch.planning.fit.model_shape import shape_from_hf_config

REPO = Path(__file__).resolve().parents[2]
SKIP_ABOVE_BYTES = 18 * GIB
HEADROOM_BYTES = 4 * GIB  # what a point leaves free of the machine's available memory (shared)
POINT_TIMEOUT_S = 900
MODES = {
    "before": {"logprob_chunk_tokens": "0", "attention": "dense", "recompute": "none"},
    "after": {},
}
# 4,096 "before" points beside the asked-for sizes: "before" at 8k (18.2-28 GiB predicted) does not
# fit this machine, and two points show its slope
FULL_POINTS = [
    (backend, mode, tokens)
    for backend in ("torch", "megatron", "fsdp")
    for tokens in (2048, 4096, 8192, 32768)
    for mode in ("after", "before")
    if tokens != 4096 or mode == "before"
]
QUICK_POINTS = [("torch", "after", 1024), ("torch", "before", 1024), ("megatron", "after", 1024)]
BENCH_CONFIG = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 65536,
    "tie_word_embeddings": True,
    "rope_theta": 1e6,
}


def build_model(out_dir: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = {k: v for k, v in BENCH_CONFIG.items() if k not in ("model_type", "architectures")}
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**config)).save_pretrained(str(out_dir))
    return out_dir


def scored_tokens(tokens: int) -> int:
    """Output positions of the bench micro-batch (trainer_memory_point.make_batch's layout)."""
    from bench.trainer.trainer_memory_point import PROMPT_TOKENS, SEQUENCE_TOKENS

    whole, rest = divmod(tokens, SEQUENCE_TOKENS)
    out = whole * (SEQUENCE_TOKENS - PROMPT_TOKENS)
    return out + (rest - min(PROMPT_TOKENS, rest // 2) if rest else 0)


def predicted_bytes(backend: str, mode: str, tokens: int) -> tuple[int, dict[str, int]]:
    """The memory model's peak for this point (CPU: no runtime reserve), and its parts."""
    knobs = {"logprob_chunk_tokens": 1024, "attention": "varlen", "recompute": "none"}
    knobs.update({k: type(knobs[k])(v) for k, v in MODES[mode].items()})
    inputs = TrainerMemoryInputs(
        backend=TrainerBackend(backend),
        param_bytes=4,
        compute_bytes=4,
        tp=1,
        pp=1,
        dp=1,
        tokens=tokens,
        scored_tokens=scored_tokens(tokens),
        on_gpu=False,
        **knobs,
    )
    estimate = trainer_memory(shape_from_hf_config(BENCH_CONFIG, "bench"), inputs)
    return estimate.total_bytes, {name: size for name, size, _ in estimate.parts}


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def point_env(threads: int = 2) -> dict[str, str]:
    """glibc: every allocation above 64 KiB is its own mapping, returned to the kernel when freed,
    so peak RSS measures live tensors, not the heap's reuse and fragmentation."""
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(threads))


def point_lock():
    """On a shared machine (TRAINER_MEMORY_LOCK=<file>), each backend's points (quick: all three)
    hold that flock(2) lock while they run, so other heavy jobs interleave between the groups."""
    path = os.environ.get("TRAINER_MEMORY_LOCK")
    return held_flock(Path(path) if path else None)


def run_point(backend: str, mode: str, tokens: int, model_dir: str, threads: int = 2) -> dict:
    cmd = [
        sys.executable, "-m", "bench.trainer.trainer_memory_point", "--backend", backend,
        "--tokens", str(tokens), "--model", model_dir, "--threads", str(threads),
    ]  # fmt: skip
    cmd += [f"--set={key}={value}" for key, value in MODES[mode].items()]
    proc = subprocess.run(
        cmd, cwd=REPO, env=point_env(threads), capture_output=True, text=True, timeout=POINT_TIMEOUT_S
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{backend} {mode} {tokens}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def _key(backend: str, mode: str, tokens: int) -> str:
    return f"trainer_memory/{backend}_{mode}_{tokens // 1024}k"


def run(quick: bool = False) -> dict[str, float]:
    """Every point of the section (quick: three 1,024-token points, run side by side)."""
    points = QUICK_POINTS if quick else FULL_POINTS
    # quick runs its points side by side: one thread each, not 2 x 3 OpenMP threads on 2 cores,
    # whose regions each wait for a descheduled thread (a 1,024-token step took 40 s so, beside the
    # suite; the peaks do not depend on it)
    threads = 1 if quick else 2
    metrics: dict[str, float] = {"trainer_memory/threads_per_point": float(threads)}
    with tempfile.TemporaryDirectory(prefix="trainer_memory_") as tmp:
        model_dir = str(build_model(Path(tmp) / "model"))
        chosen = []
        for backend, mode, tokens in points:
            key = _key(backend, mode, tokens)
            predicted, _ = predicted_bytes(backend, mode, tokens)
            metrics[f"{key}_predicted_gib"] = predicted / GIB
            if predicted > SKIP_ABOVE_BYTES:
                metrics[f"{key}_skipped"] = 1.0
                print(
                    f"[trainer_memory] {key}: skipped (predicted {predicted / GIB:.1f} GiB)", file=sys.stderr
                )
            else:
                chosen.append((backend, mode, tokens, predicted))
        # quick: the three points side by side; full: one at a time (each takes the machine),
        # one lock per backend's group of points
        groups = (
            [chosen]
            if quick
            else [[p for p in chosen if p[0] == b] for b in dict.fromkeys(p[0] for p in chosen)]
        )
        for group in groups:
            with point_lock(), concurrent.futures.ThreadPoolExecutor(len(group) if quick else 1) as pool:
                futures = {
                    pool.submit(_run_if_room, b, m, t, p, model_dir, threads): (b, m, t, p)
                    for b, m, t, p in group
                }
                for future in concurrent.futures.as_completed(futures):
                    backend, mode, tokens, predicted = futures[future]
                    result = future.result()
                    key = _key(backend, mode, tokens)
                    if result is None:
                        metrics[f"{key}_skipped"] = 1.0
                        continue
                    metrics.update(_point_metrics(key, result, predicted, tokens))
                    print(
                        f"[trainer_memory] {key}: {result['peak_bytes'] / GIB:.2f} GiB "
                        f"(predicted {predicted / GIB:.2f}), {result['tokens_per_s']:.0f} tokens/s",
                        file=sys.stderr,
                        flush=True,
                    )
    metrics.update(_slopes(metrics, points))
    return metrics


def _run_if_room(
    backend: str, mode: str, tokens: int, predicted: int, model_dir: str, threads: int = 2
) -> dict | None:
    """The point, unless the machine's available memory cannot hold it right now (None)."""
    free = available_bytes()
    if predicted > free - HEADROOM_BYTES:
        print(
            f"[trainer_memory] {_key(backend, mode, tokens)}: skipped, {predicted / GIB:.1f} GiB predicted "
            f"and {free / GIB:.1f} GiB available",
            file=sys.stderr,
        )
        return None
    return run_point(backend, mode, tokens, model_dir, threads)


def _point_metrics(key: str, result: dict, predicted: int, tokens: int) -> dict[str, float]:
    vocab = BENCH_CONFIG["vocab_size"]
    largest = result["largest"][0] if result["largest"] else {"bytes": 0, "shape": [], "dtype": ""}
    tv, tt = full_size_tensors(result["largest"], tokens, vocab)
    return {
        f"{key}_peak_gib": result["peak_bytes"] / GIB,
        f"{key}_step_peak_gib": (
            result["peak_bytes"] + result["baseline_rss_bytes"] - result["step_start_rss_bytes"]
        )
        / GIB,
        f"{key}_predicted_over_measured": predicted / result["peak_bytes"],
        f"{key}_tokens_per_s": result["tokens_per_s"],
        f"{key}_largest_tensor_mib": largest["bytes"] / (1 << 20),
        f"{key}_has_TxV_or_TxT_float32": float(tv or tt),
    }


def full_size_tensors(largest: list[dict], tokens: int, vocab: int) -> tuple[bool, bool]:
    """(a float32 tensor of every scored position by the vocabulary, one of tokens by tokens)
    among the step's largest tensors, by shape: a chunk of the LM head ([chunk, V]) is neither."""
    float32 = [t for t in largest if t["dtype"] == "float32"]
    rows = scored_tokens(tokens)

    def others(shape: list[int], dim: int) -> int:
        rest = list(shape)
        rest.remove(dim)
        return math.prod(rest)

    tv = any(vocab in t["shape"] and others(t["shape"], vocab) >= rows for t in float32)
    tt = any(t["shape"].count(tokens) >= 2 for t in float32)
    return tv, tt


def _slopes(metrics: dict[str, float], points: list[tuple[str, str, int]]) -> dict[str, float]:
    """Bytes per token of each backend's "after" curve between its two largest measured points."""
    out = {}
    for backend in sorted({b for b, _, _ in points}):
        sizes = sorted(t for b, m, t in points if b == backend and m == "after")
        measured = [t for t in sizes if f"{_key(backend, 'after', t)}_peak_gib" in metrics]
        if len(measured) >= 2:
            lo, hi = measured[-2], measured[-1]
            rise = (
                metrics[f"{_key(backend, 'after', hi)}_peak_gib"]
                - metrics[f"{_key(backend, 'after', lo)}_peak_gib"]
            )
            out[f"trainer_memory/{backend}_after_bytes_per_token"] = rise * GIB / (hi - lo)
    return out


def table(metrics: dict[str, float]) -> str:
    """Markdown: one row per point, the measured peak beside the model's prediction."""
    rows = sorted(
        {k.rsplit("_predicted_gib", 1)[0] for k in metrics if k.endswith("_predicted_gib")},
        key=lambda k: (k.split("/")[1].split("_")[0], int(k.rsplit("_", 1)[1].removesuffix("k")), k),
    )
    lines = [
        "### trainer_memory: one step of one micro-batch (CPU, float32, width 64, vocab 151,936)",
        "",
        "| backend | path | tokens | peak GiB | predicted GiB | predicted / peak | tokens/s | largest tensor MiB | [T,V] or [T,T] fp32 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for key in rows:
        backend, mode, size = key.split("/")[1].split("_")
        pred = metrics[f"{key}_predicted_gib"]
        if metrics.get(f"{key}_skipped"):
            lines.append(f"| {backend} | {mode} | {size} | skipped | {pred:.2f} | - | - | - | - |")
            continue
        if f"{key}_peak_gib" not in metrics:
            continue
        lines.append(
            f"| {backend} | {mode} | {size} | {metrics[f'{key}_peak_gib']:.2f} | {pred:.2f} | "
            f"{metrics[f'{key}_predicted_over_measured']:.2f} | {metrics[f'{key}_tokens_per_s']:,.0f} | "
            f"{metrics[f'{key}_largest_tensor_mib']:,.0f} | "
            f"{'yes' if metrics[f'{key}_has_TxV_or_TxT_float32'] else 'no'} |"
        )
    slopes = {k: v for k, v in metrics.items() if k.endswith("_after_bytes_per_token")}
    if slopes:
        lines += [
            "",
            "after: "
            + ", ".join(
                f"{k.split('/')[1].split('_')[0]} {v / 1e3:,.0f} kB/token" for k, v in slopes.items()
            ),
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    out = run(quick="--quick" in sys.argv[1:])
    print(table(out))
