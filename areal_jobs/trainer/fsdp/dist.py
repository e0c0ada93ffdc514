"""The FSDP backend's process group and its reductions over the DP ranks (trainer/fsdp/backend.py)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from areal_jobs.config import TrainerConfig
from areal_jobs.trainer.dist.process_group import join_default_group
from areal_jobs.trainer.objective.loss import LossStats


def init_distributed(trainer: TrainerConfig, *, timeout_s: float | None = None) -> None:
    """Call first on every trainer rank: join the default group from env:// (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT, as srun or launch.local set them), NCCL on LOCAL_RANK's GPU, else gloo.
    A lone process without those variables (dp_size 1) gets a private one-rank group."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    join_default_group(
        "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
        timeout_s or trainer.batch_wait_timeout_s + 600.0,
        trainer.dp_size,
        f"trainer.dp_size={trainer.dp_size}",
    )


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def sum_over_ranks(values: list[float]) -> list[float]:
    """Sums over the DP ranks (collective: every rank calls it at the same step)."""
    row = torch.tensor(values, dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(row)
    return row.tolist()


def reduce_step(
    loss: float, stats: LossStats, gap: torch.Tensor, num_micro: int
) -> tuple[float, LossStats, torch.Tensor, int]:
    """A step's figures summed over the DP ranks (each rank saw only its share of the tokens);
    the maxima by max. Collective."""
    sums = stats.sums()
    row = torch.cat(
        [torch.tensor([loss, *gap.tolist(), num_micro], dtype=torch.float64), torch.from_numpy(sums)]
    )
    maxes = torch.from_numpy(stats.maxes())
    if dist.get_world_size() > 1:
        dist.all_reduce(row)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    total = LossStats.from_reduced(row[4:].numpy(), maxes.numpy())
    return float(row[0]), total, row[1:3], int(row[3])
