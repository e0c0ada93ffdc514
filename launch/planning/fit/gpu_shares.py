"""How the memory of a GPU that several processes share is divided between them (issue 28). Pure.

Who shares a GPU:
  nodes / gpus placement  nobody: each GPU is one server's (its TP group) or one trainer rank's; the
                          engines keep their defaults and the trainer is not capped
  colocated               every GPU: one server (its share of a TP group) and one trainer rank
  launch.local            every server starts at GPU 0 (GPUs 0..TP-1) and trainer rank r uses GPU r:
                          GPU 0 holds every server and trainer rank 0

On a shared GPU, RESERVE is kept back (CUDA contexts, NCCL buffers, allocator slack, and SGLang's
activations, which live outside its static share). A server's share is rollout.gpu_memory_fraction
when the user set it; else, when a trainer rank's peak bytes are known (the trainer memory model,
`trainer_bytes`), what the trainer leaves; else an even split between the processes on the GPU.
Each trainer rank is capped at what the servers leave, except with the colocated schedule's
release (rollout.release_memory_while_training): the servers free their memory while the trainer
steps, so the trainer may then use everything but the reserve, and gives its cached blocks back
after each step for the servers to take their share again (trainer/dist/gpu_memory.py).

Shares go to SGLang as --mem-fraction-static, to vLLM as --gpu-memory-utilization and to the
trainer as torch.cuda.set_per_process_memory_fraction; all three only on GPU machines.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from areal_jobs.config import JobConfig

RESERVE = 0.10  # of a shared GPU: contexts, communicators, allocator slack, SGLang's activations
MIN_SHARE = 0.05  # below this a process cannot hold even a small model: refuse


@dataclass(frozen=True)
class GpuShares:
    """The division of one shared GPU (0 fractions: the GPU is not shared)."""

    servers_per_gpu: int
    trainer_ranks_per_gpu: int
    server_fraction: float  # rollout.gpu_memory_fraction; 0 = the engine's default
    trainer_fraction: float  # trainer.gpu_memory_fraction; 0 = no cap
    release_while_training: bool

    def describe(self) -> str:
        if not self.server_fraction and not self.trainer_fraction:
            return "GPU memory: no GPU is shared between processes (engine defaults, trainer uncapped)"
        servers = f"{self.servers_per_gpu} server{'s' if self.servers_per_gpu != 1 else ''}"
        text = (
            f"GPU memory per shared GPU: {servers} x {self.server_fraction:.3f} + "
            f"{self.trainer_ranks_per_gpu} trainer rank x {self.trainer_fraction:.3f}, {RESERVE:.2f} kept back"
        )
        if self.release_while_training:
            text += " (the servers free theirs while the trainer steps)"
        return text


def shares_for(
    job: JobConfig,
    servers_per_gpu: int,
    trainer_ranks_per_gpu: int,
    trainer_bytes: int | None = None,
    gpu_bytes: int | None = None,
) -> GpuShares:
    """The division of a GPU holding `servers_per_gpu` servers and `trainer_ranks_per_gpu` trainer
    ranks. `trainer_bytes` / `gpu_bytes`: a trainer rank's predicted peak and the GPU's memory, when
    the trainer memory model gives them. ValueError naming the override when a share is too small."""
    requested = job.rollout.gpu_memory_fraction
    release = job.rollout.release_memory_while_training
    if servers_per_gpu == 0 or servers_per_gpu + trainer_ranks_per_gpu < 2:
        return GpuShares(servers_per_gpu, trainer_ranks_per_gpu, requested, 0.0, release)
    usable = 1.0 - RESERVE
    if requested:
        server = requested
    elif trainer_bytes is not None and gpu_bytes:
        server = (usable - trainer_ranks_per_gpu * trainer_bytes / gpu_bytes) / servers_per_gpu
    else:
        server = usable / (servers_per_gpu + trainer_ranks_per_gpu)
    if server < MIN_SHARE:
        raise ValueError(
            f"a shared GPU leaves {max(server, 0):.3f} of its memory to each of {servers_per_gpu} server(s): "
            "set rollout.gpu_memory_fraction, lower rollout.num_servers on this machine, or give the "
            "trainer more GPUs"
        )
    trainer = 0.0
    if trainer_ranks_per_gpu:
        left = usable - servers_per_gpu * server
        trainer = usable if release else left / trainer_ranks_per_gpu
        if left / trainer_ranks_per_gpu < MIN_SHARE:
            raise ValueError(
                f"{servers_per_gpu} server(s) x rollout.gpu_memory_fraction={server:.3f} leave "
                f"{max(left, 0):.3f} of a shared GPU to the trainer: lower rollout.gpu_memory_fraction "
                "(or rollout.num_servers on this machine)"
            )
    return GpuShares(servers_per_gpu, trainer_ranks_per_gpu, round(server, 4), round(trainer, 4), release)


def local_shares(job: JobConfig) -> GpuShares:
    """launch.local: GPU 0 holds every server and trainer rank 0 (module docstring)."""
    return shares_for(job, job.rollout.num_servers, 1)


def apply_shares(job: JobConfig, shares: GpuShares) -> JobConfig:
    """The config the roles read, with their shares written in."""
    return dataclasses.replace(
        job,
        rollout=dataclasses.replace(job.rollout, gpu_memory_fraction=shares.server_fraction),
        trainer=dataclasses.replace(job.trainer, gpu_memory_fraction=shares.trainer_fraction),
    )
