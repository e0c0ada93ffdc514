"""Process groups for the Megatron backend: the default group (gloo on CPU, NCCL on GPU) and
Megatron's model-parallel state, set up once per trainer rank and torn down at the end."""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from areal_jobs.config import TrainerConfig
from areal_jobs.trainer.dist.process_group import join_default_group


def init_distributed(trainer: TrainerConfig, *, timeout_s: float | None = None) -> None:
    """Call first on every trainer rank: process group, Megatron model-parallel state, seeds.

    Joins the default process group from env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as
    torchrun or the SLURM launcher set them) unless it already exists; a lone trainer process
    without those variables (tp = pp = dp = 1) gets a private one-rank group. Without a CUDA
    device it switches on megatron_cpu_compat and uses gloo; with one, NCCL on LOCAL_RANK.
    Megatron's rank order is tp fastest, then dp, then pp: global rank 0 is TP/DP/PP rank 0.
    `timeout_s` bounds every collective, including the other ranks' wait in `train_step` while
    rank 0 waits for a batch: by default trainer.batch_wait_timeout_s + 600.
    """
    expected = trainer.tp_size * trainer.pp_size * trainer.dp_size
    experts = trainer.ep_size * trainer.expert_tp_size
    if (trainer.tp_size * trainer.dp_size) % experts:  # TrainerConfig checks it only once dp_size > 1
        raise ValueError(
            f"trainer.ep_size={trainer.ep_size} x trainer.expert_tp_size={trainer.expert_tp_size} must divide "
            f"trainer.tp_size={trainer.tp_size} x trainer.dp_size={trainer.dp_size} (the expert grid folds onto "
            f"those ranks): set trainer.dp_size={experts // math.gcd(experts, trainer.tp_size)} or a multiple"
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        from areal_jobs.trainer.megatron import cpu_compat as megatron_cpu_compat

        megatron_cpu_compat.enable()
        torch.set_num_threads(trainer.threads)
    join_default_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        timeout_s or trainer.batch_wait_timeout_s + 600.0,
        expected,
        f"trainer.tp_size * pp_size * dp_size = {trainer.tp_size} * {trainer.pp_size} * {trainer.dp_size}",
    )
    if not parallel_state.model_parallel_is_initialized():
        # the expert grid (expert TP x EP x expert DP per stage) folds onto the same ranks as the
        # dense one: trainer.ep_size x expert_tp_size divides tp x dp (TrainerConfig checks it)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=trainer.tp_size,
            pipeline_model_parallel_size=trainer.pp_size,
            expert_model_parallel_size=trainer.ep_size,
            expert_tensor_parallel_size=trainer.expert_tp_size,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(trainer.seed)


def shutdown_distributed() -> None:
    """Tear down what `init_distributed` set up (end of a run or a test)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
