"""Trainer throughput: the torch backend and Megatron (TP=1) side by side on the same batch.

Both train the built-in model's architecture (tiny Qwen2, `data.tiny_model.model_config`, random
weights) on one synthetic batch shaped like the built-in task: 8 groups of 8 answers (quick: 2
groups). Tokens/s = batch tokens (prompt + output) / wall time of `train_step` (proximal
log-probs, forward/backward over the balanced micro-batches, optimizer step), median over the
timed steps after one warm-up step. Each backend runs in its own spawned process with one torch
thread: Megatron's CPU compatibility layer is process-wide and must not slow the torch backend.
The first-step losses of the two must agree (`trainer/bench_first_loss_abs_diff`), so a fast but
wrong backend cannot look good.

Run: `python -m bench.trainer_bench [--quick]`.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from areal_jobs.config import AlgoConfig, DType, TrainerBackend, TrainerConfig

GROUP_SIZE = 8
TIMEOUT_S = 900.0


def build_model(out_dir: Path) -> Path:
    import torch
    from transformers import Qwen2ForCausalLM

    from areal_jobs.data.tiny_model import TinyRecipe, model_config

    recipe = TinyRecipe()
    torch.manual_seed(0)
    Qwen2ForCausalLM(model_config(recipe, recipe.vocab_size)).save_pretrained(str(out_dir))
    return out_dir


def make_batch(num_groups: int, vocab_size: int):
    """Prompts of 20-40 tokens, answers of 20-100 (the built-in task's range), random tokens."""
    from areal_jobs.trainer.batch import TrainBatch, TrainSample

    rng = np.random.default_rng(0)
    samples = []
    for g in range(num_groups):
        prompt = rng.integers(1, vocab_size, size=int(rng.integers(20, 41)))
        rewards = rng.integers(0, 2, size=GROUP_SIZE).astype(np.float64)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for i in range(GROUP_SIZE):
            n = int(rng.integers(20, 101))
            samples.append(
                TrainSample(
                    sample_id=f"g{g}s{i}",
                    input_ids=np.concatenate([prompt, rng.integers(1, vocab_size, size=n)]).astype(np.int64),
                    num_prompt_tokens=len(prompt),
                    behav_logprobs=(np.log(1.0 / vocab_size) + 0.1 * rng.standard_normal(n)).astype(
                        np.float32
                    ),
                    versions=np.zeros(n, dtype=np.int32),
                    advantage=float(advantages[i]),
                    reward=float(rewards[i]),
                )
            )
    return TrainBatch(version=0, samples=samples, group_ids=[f"g{g}" for g in range(num_groups)])


def _measure(kind: str, model_dir: str, num_groups: int, steps: int, results) -> None:
    import torch

    torch.set_num_threads(1)
    backend_kind = TrainerBackend(kind)
    trainer = TrainerConfig(backend=backend_kind, lr=1e-5, max_tokens_per_microbatch=2048, threads=1)
    if backend_kind is TrainerBackend.megatron:
        from areal_jobs.trainer.megatron_backend import MegatronBackend as Backend
    else:
        from areal_jobs.trainer.torch_backend import TorchBackend as Backend
    backend = Backend(trainer, AlgoConfig(), model_dir, DType.float32)
    backend.setup()  # Megatron: a lone process forms its own one-rank gloo/NCCL group
    from areal_jobs.data.tiny_model import TinyRecipe

    batch = make_batch(num_groups, TinyRecipe().vocab_size)
    first_loss = backend.train_step(batch)["train/loss"]  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        backend.train_step(batch)
        times.append(time.perf_counter() - t0)
    tokens = sum(len(s.input_ids) for s in batch.samples)
    results.put((kind, tokens, statistics.median(times), first_loss))


def _run_isolated(kind: str, model_dir: str, num_groups: int, steps: int) -> tuple[int, float, float]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(kind, model_dir, num_groups, steps, results))
    proc.start()
    try:
        _, tokens, step_s, first_loss = results.get(timeout=TIMEOUT_S)
    except Exception as exc:  # queue.Empty or a dead child: name the backend that failed
        raise RuntimeError(
            f"trainer bench: the {kind} backend gave no result (exit code {proc.exitcode})"
        ) from exc
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
    return tokens, step_s, first_loss


def run(quick: bool = False) -> dict[str, float]:
    """Trainer tokens/s of the torch and Megatron backends on the same batch and weights."""
    num_groups, steps = (2, 2) if quick else (8, 3)
    with tempfile.TemporaryDirectory(prefix="trainer_bench_") as tmp:
        model_dir = str(build_model(Path(tmp) / "model"))
        tokens, torch_s, torch_loss = _run_isolated("torch", model_dir, num_groups, steps)
        _, megatron_s, megatron_loss = _run_isolated("megatron", model_dir, num_groups, steps)
    return {
        "trainer/bench_batch_tokens": float(tokens),
        "trainer/torch_tokens_per_s": tokens / torch_s,
        "trainer/megatron_tokens_per_s": tokens / megatron_s,
        "trainer/megatron_over_torch": torch_s / megatron_s,
        "trainer/bench_first_loss_abs_diff": abs(torch_loss - megatron_loss),
    }


if __name__ == "__main__":
    for name, value in run(quick="--quick" in sys.argv[1:]).items():
        print(f"{name} {value:.6g}")
