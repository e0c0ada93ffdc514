"""Packing: the share of non-padding tokens, and micro-batch token imbalance (max / mean) of the
balanced allocator (`balanced_microbatches`, largest first) against the naive split (arrival order).

Two workloads, each over many training steps:
  task    the built-in task: prompt + worked solution + EOS of `arith_task` problems through the
          built-in tokenizer (what the trainer sees once the policy has learned the format), 64
          sequences per step (B=8 x G=8), micro-batch budget 1024 tokens;
  paper   the simulator's paper profile: B=512 x G=16 answers of its long-tailed length model
          (up to 32k tokens) plus 512-token prompts, budget 65536 tokens (two longest sequences).
Padded share = real tokens / (micro-batches x their longest sequence x sequences), the layout a
padded [batch, max_len] tensor would have for the same micro-batches; the packed layout (`pack`)
carries no padding at all, which is counted from the packed tensors themselves (task workload).

Run: `python -m bench.trainer.packing_bench [--quick]`.
"""

from __future__ import annotations

import sys

import numpy as np

from areal_jobs.tasks import arith_task
from areal_jobs.trainer.intake.packing import balanced_microbatches, imbalance, naive_microbatches, pack


def task_steps(num_steps: int, per_step: int = 64) -> list[list[int]]:
    """Sequence lengths (prompt + solution + EOS) of the built-in task, `per_step` per step."""
    from areal_jobs.data.tokenizer import load_tokenizer
    from bench.harness import bench_model

    tok = load_tokenizer(str(bench_model()))
    steps = []
    for step in range(num_steps):
        problems = [arith_task.problem_at(7, step * per_step + i) for i in range(per_step)]
        steps.append([len(tok.encode(p.prompt)) + len(tok.encode(p.solution)) + 1 for p in problems])
    return steps


def paper_steps(num_steps: int) -> list[list[int]]:
    from launch.planning.sim.engine import group_lengths
    from launch.planning.sim.profile import load_profile

    p = load_profile("paper_1p5b")
    G, B, prompt = p.algo.group_size, p.algo.batch_size, p.lengths.prompt_tokens
    return [
        [prompt + n for g in range(B) for n in group_lengths(p.lengths, G, p.run.seed, step * B + g, 0)]
        for step in range(num_steps)
    ]


def measure(steps: list[list[int]], budget: int, prefix: str, materialize: bool) -> dict[str, float]:
    balanced, naive, padded, packed_tokens, real_tokens, micro = [], [], [], 0, 0, 0
    for lengths in steps:
        bins = balanced_microbatches(lengths, budget)
        balanced.append(imbalance(lengths, bins))
        naive.append(imbalance(lengths, naive_microbatches(lengths, budget)))
        padded.append(sum(lengths) / sum(len(b) * max(lengths[i] for i in b) for b in bins))
        for b in bins:  # the paper workload is ~50M tokens a step: its packed size is its sum
            packed_tokens += (
                pack([np.zeros(lengths[i], np.int64) for i in b]).num_tokens
                if materialize
                else sum(lengths[i] for i in b)
            )
        real_tokens += sum(lengths)
        micro += len(bins)
    return {
        f"packing/{prefix}_nonpad_share_packed": real_tokens / packed_tokens,
        f"packing/{prefix}_nonpad_share_padded": float(np.mean(padded)),
        f"packing/{prefix}_budget_fill": real_tokens / (micro * budget),
        f"packing/{prefix}_imbalance_balanced": float(np.mean(balanced)),
        f"packing/{prefix}_imbalance_naive": float(np.mean(naive)),
        f"packing/{prefix}_microbatches_per_step": micro / len(steps),
    }


def run(quick: bool = False) -> dict[str, float]:
    """Non-padding share and micro-batch imbalance, balanced vs naive, task and paper workloads."""
    out = measure(task_steps(10 if quick else 50), 1024, "task", materialize=True)
    out.update(measure(paper_steps(1 if quick else 4), 65536, "paper", materialize=False))
    return out


if __name__ == "__main__":
    for name, value in run(quick="--quick" in sys.argv[1:]).items():
        print(f"{name} {value:.4g}")
