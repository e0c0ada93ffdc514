"""Trainer throughput: the torch backend and Megatron (TP=1) side by side on the same batch.

Both train the built-in model's architecture (tiny Qwen2, `data.tiny_model.model_config`, random
weights) on one synthetic batch shaped like the built-in task: 8 groups of 8 answers (quick: 2
groups). Tokens/s = batch tokens (prompt + output) / wall time of `train_step` (proximal
log-probs, forward/backward over the balanced micro-batches, optimizer step), median over the
timed steps after one warm-up step. Each backend runs in its own spawned process with one torch
thread (Megatron's CPU compatibility layer is process-wide and must not touch the torch
backend), and their timed steps alternate, so load from other work on the machine hits both.
The first-step losses of the two must agree (`trainer/bench_first_loss_abs_diff`), so a fast but
wrong backend cannot look good.

Run: `python -m bench.trainer.trainer_bench [--quick]`.
"""

from __future__ import annotations

import contextlib
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

    from areal_jobs.tasks.warm_start.tiny_model import TinyRecipe, model_config

    recipe = TinyRecipe()
    torch.manual_seed(0)
    Qwen2ForCausalLM(model_config(recipe, recipe.vocab_size)).save_pretrained(str(out_dir))
    return out_dir


def make_batch(num_groups: int, vocab_size: int):
    """Prompts of 20-40 tokens, answers of 20-100 (the built-in task's range), random tokens."""
    from areal_jobs.trainer.intake.batch import TrainBatch, TrainSample

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


def _serve_steps(kind: str, model_dir: str, num_groups: int, conn) -> None:
    """Child process: set the backend up, take a warm-up step, then one timed step per "step"."""
    import torch

    torch.set_num_threads(1)
    backend_kind = TrainerBackend(kind)
    trainer = TrainerConfig(backend=backend_kind, lr=1e-5, max_tokens_per_microbatch=2048, threads=1)
    if backend_kind is TrainerBackend.megatron:
        from areal_jobs.trainer.megatron.backend import MegatronBackend as Backend
    else:
        from areal_jobs.trainer.torch.backend import TorchBackend as Backend
    from areal_jobs.tasks.warm_start.tiny_model import TinyRecipe

    backend = Backend(trainer, AlgoConfig(), model_dir, DType.float32)
    backend.setup()  # Megatron: a lone process forms its own one-rank gloo/NCCL group
    batch = make_batch(num_groups, TinyRecipe().vocab_size)
    first_loss = backend.train_step(batch)["train/loss"]  # warm-up
    conn.send((sum(len(s.input_ids) for s in batch.samples), first_loss))
    while conn.recv() == "step":
        t0 = time.perf_counter()
        backend.train_step(batch)
        conn.send(time.perf_counter() - t0)


def _reply(kind: str, conn, proc) -> object:
    if not conn.poll(TIMEOUT_S):
        raise RuntimeError(
            f"trainer bench: the {kind} backend gave no answer in {TIMEOUT_S:.0f}s (exit {proc.exitcode})"
        )
    return conn.recv()


def _interleaved(model_dir: str, num_groups: int, steps: int) -> dict[str, tuple[int, float, float]]:
    """Both backends in their own processes, timed steps alternating between them, so a noisy
    shared machine slows both alike. Returns kind -> (batch tokens, median step s, first loss)."""
    ctx = mp.get_context("spawn")
    workers = {}
    try:
        for kind in ("torch", "megatron"):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve_steps, args=(kind, model_dir, num_groups, child))
            proc.start()
            workers[kind] = (parent, proc)
        ready = {kind: _reply(kind, conn, proc) for kind, (conn, proc) in workers.items()}
        times: dict[str, list[float]] = {kind: [] for kind in workers}
        for _ in range(steps):
            for kind, (conn, proc) in workers.items():
                conn.send("step")
                times[kind].append(float(_reply(kind, conn, proc)))
        return {k: (ready[k][0], statistics.median(times[k]), ready[k][1]) for k in workers}
    finally:
        for conn, proc in workers.values():
            if proc.is_alive():
                with contextlib.suppress(OSError):  # the child may be gone already
                    conn.send("stop")
                proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)


def run(quick: bool = False) -> dict[str, float]:
    """Trainer tokens/s of the torch and Megatron backends on the same batch and weights."""
    num_groups, steps = (2, 2) if quick else (8, 5)
    with tempfile.TemporaryDirectory(prefix="trainer_bench_") as tmp:
        model_dir = str(build_model(Path(tmp) / "model"))
        results = _interleaved(model_dir, num_groups, steps)
    tokens, torch_s, torch_loss = results["torch"]
    _, megatron_s, megatron_loss = results["megatron"]
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
