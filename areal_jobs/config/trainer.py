"""The trainer: backend, optimiser and layout; weight sync; checkpoints."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TrainerBackend(enum.Enum):
    torch = "torch"  # Hugging Face model class, plain torch (CPU and small runs)
    megatron = "megatron"  # Megatron-Core GPTModel with TP/PP/DP
    fsdp = "fsdp"  # Hugging Face model sharded with torch FSDP2 (fully_shard), DP ranks only


class WeightSync(enum.Enum):
    distributed = "distributed"  # torch.distributed broadcast (NCCL on GPU, gloo on CPU)
    disk = "disk"  # safetensors checkpoint + /update_weights_from_disk


class DistBackend(enum.Enum):
    auto = "auto"  # nccl when CUDA is available, else gloo
    nccl = "nccl"
    gloo = "gloo"


@dataclass
class TrainerConfig:
    """Policy optimisation: the backend, optimiser, packing and parallel layout."""

    backend: TrainerBackend = TrainerBackend.torch
    total_steps: int = 100
    lr: float = 1.5e-4  # built-in task: 3e-4 unlearned its misconception but could break the "+" token
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0
    max_tokens_per_microbatch: int = 1024  # packing budget; every micro-batch gets about the same
    threads: int = 1  # torch threads per trainer process (CPU mode)
    seed: int = 1
    tp_size: int = 1  # megatron only
    pp_size: int = 1  # megatron only
    dp_size: int = 1  # megatron and fsdp; trainer processes = tp * pp * dp
    megatron_vocab_multiple: int = 128  # megatron only: vocab padded to a multiple of this; tp must divide it
    batch_wait_timeout_s: float = 1800.0  # no trajectories for this long = rollout side is dead
    # fsdp only: compute in bfloat16 with float32 parameters and gradient reduction (model.dtype=float32)
    fsdp_mixed_precision: bool = False
    fsdp_activation_checkpointing: bool = False  # fsdp only: recompute each decoder layer in backward
    # cap on each rank's share of its GPU's memory (torch.cuda.set_per_process_memory_fraction) where
    # it shares the GPU with rollout servers; 0 = none. Set by the planner (gpu_shares.py)
    gpu_memory_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.backend is TrainerBackend.torch and self.tp_size * self.pp_size * self.dp_size != 1:
            raise ValueError("trainer.backend=torch runs one process: use trainer=megatron for TP/PP/DP")
        if self.backend is TrainerBackend.fsdp and self.tp_size * self.pp_size != 1:
            raise ValueError(
                "trainer.backend=fsdp shards over data-parallel ranks only: set trainer.tp_size=1 and "
                "trainer.pp_size=1 (or use trainer=megatron)"
            )
        if self.total_steps < 1:
            raise ValueError("trainer.total_steps must be >= 1")
        if not 0.0 <= self.gpu_memory_fraction <= 1.0:
            raise ValueError("trainer.gpu_memory_fraction must be in [0, 1] (0 = no cap)")
        if self.max_tokens_per_microbatch < 16:
            raise ValueError("trainer.max_tokens_per_microbatch must be >= 16")
        if self.megatron_vocab_multiple % self.tp_size:  # megatron: padded vocab splits evenly over TP
            raise ValueError(
                f"trainer.megatron_vocab_multiple must be a multiple of trainer.tp_size={self.tp_size}"
            )


@dataclass
class WeightSyncConfig:
    """How new weights reach the rollout servers after every step."""

    method: WeightSync = WeightSync.distributed
    backend: DistBackend = DistBackend.auto
    bucket_bytes: int = 1 << 30  # weights are sent in flattened buckets of at most this size
    master_port: int = 0  # 0 = pick a free port (local); set in cluster mode
    step_timeout_s: float = 120.0  # each handshake step (pause, group init, bucket, resume)


@dataclass
class CheckpointConfig:
    """Periodic and on-signal checkpoints; resume from the newest one."""

    every_steps: int = 0  # 0 = only at the end and on SIGUSR1/SIGTERM
    keep_last: int = 2
    resume: bool = True  # resume from runs/<name>/checkpoints when present
