"""Which train backend runs (`trainer.backend`), and the process group it needs: the one place
that names them all, so the entry point stays free of `if backend == ...` branches."""

from __future__ import annotations

from areal_jobs.api import TrainBackend
from areal_jobs.config import JobConfig, TrainerBackend
from areal_jobs.trainer.dist.ranks import RankChannel, command_timeout_s


def join_ranks(cfg: JobConfig) -> RankChannel:
    """Megatron and FSDP: join the trainer's process group first, on every rank (before ZeroMQ
    or anything)."""
    backend = cfg.trainer.backend
    if backend is TrainerBackend.megatron:
        from areal_jobs.trainer.megatron.dist import init_distributed
    elif backend is TrainerBackend.fsdp:
        from areal_jobs.trainer.fsdp.backend import init_distributed
    else:
        return RankChannel.single()
    init_distributed(cfg.trainer)
    return RankChannel.join(command_timeout_s(cfg))


def build_backend(cfg: JobConfig) -> TrainBackend:
    """The backend object (not set up yet: `setup()` loads the model, collectively). Its log-probs
    are of the policy that sampled the data: the model's logits divided by rollout.temperature."""
    model_path = cfg.model.path or cfg.model.builtin_dir
    temperature = cfg.rollout.temperature
    if cfg.trainer.backend is TrainerBackend.megatron:
        from areal_jobs.trainer.megatron.backend import MegatronBackend

        return MegatronBackend(cfg.trainer, cfg.algo, model_path, cfg.model.dtype, temperature=temperature)
    if cfg.trainer.backend is TrainerBackend.fsdp:
        from areal_jobs.trainer.fsdp.backend import FSDPBackend

        return FSDPBackend(
            cfg.trainer, cfg.algo, model_path, cfg.model.dtype, cfg.model.lora, temperature=temperature
        )
    from areal_jobs.trainer.torch.backend import TorchBackend

    return TorchBackend(
        cfg.trainer, cfg.algo, model_path, cfg.model.dtype, cfg.model.lora, temperature=temperature
    )


def pipeline_stage(cfg: JobConfig, rank: int) -> int:
    """Megatron's global rank order: tp fastest, then dp, then pp (FSDP: one stage, rank 0 sends)."""
    return rank // (cfg.trainer.tp_size * cfg.trainer.dp_size)


def leave_ranks(cfg: JobConfig) -> None:
    """After a clean run: leave the process group `join_ranks` joined."""
    if cfg.trainer.backend is TrainerBackend.megatron:
        from areal_jobs.trainer.megatron.dist import shutdown_distributed

        shutdown_distributed()
    elif cfg.trainer.backend is TrainerBackend.fsdp:
        from areal_jobs.trainer.fsdp.backend import shutdown_distributed

        shutdown_distributed()
