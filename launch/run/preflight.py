"""Checks before any process of `make run` starts, and the one line naming what trains what.

Each names the override to change (SystemExit "invalid configuration: ..."): a bad model path, a
prompt that cannot be built, a mixture of experts or a LoRA adapter the engine cannot serve, a kernel
the trainer's device lacks, a reward model or reward function that would fail minutes in. They run
before the run directory is touched, so a refused run loses nothing (launch/run/local.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from areal_jobs.config import JobConfig, RewardSource
from launch.planning import reward_files
from launch.planning.fit.memory_plan import check_memory, local_layout


def ensure_model(cfg: JobConfig) -> None:
    if cfg.model.path:
        if not (Path(cfg.model.path) / "config.json").exists():
            raise SystemExit(
                f"model.path={cfg.model.path} has no config.json: point it at a Hugging Face model directory"
            )
        return
    from areal_jobs.tasks.warm_start.tiny_model import TinyRecipe, build_builtin_model

    build_builtin_model(Path(cfg.model.builtin_dir), TinyRecipe(sft_steps=cfg.model.builtin_sft_steps))


def gpu_visible() -> bool:
    """A CUDA device this run's processes would use (checked without importing torch)."""
    return Path("/dev/nvidia0").exists() and os.environ.get("CUDA_VISIBLE_DEVICES", "0") != ""


def check_local_memory(cfg: JobConfig) -> None:
    """On a machine with GPUs, the planner's memory check (launch/planning/fit/memory_plan.py): the
    trainer ranks and the servers share them. On CPU there is nothing to divide."""
    if not gpu_visible():
        return
    try:
        report = check_memory(cfg, local_layout(cfg))
    except ValueError as exc:
        raise SystemExit(f"invalid configuration: {exc}") from None
    if report is not None:
        print(report.describe(), flush=True)


def print_first_prompt(cfg: JobConfig) -> None:
    """Show exactly what the model gets (chat template, system prompt, instruction) before any
    process starts: a wrong prompt is the most common reason a reward curve stays flat."""
    from areal_jobs.data.prompts import describe_first_prompt, load_prompts
    from areal_jobs.data.tokenizer import load_tokenizer

    model_dir = cfg.model.path or cfg.model.builtin_dir
    try:
        prompts = load_prompts(cfg.data, model_dir, load_tokenizer(model_dir).encode, cfg.reward.function)
    except (OSError, ValueError) as exc:  # a missing file, no usable row: before any process starts
        raise SystemExit(f"cannot build the prompts: {exc}") from None
    print(describe_first_prompt(prompts), flush=True)


def describe_policy(cfg: JobConfig) -> str:
    """One line: the policy's architecture (experts and top-k for a mixture of experts), the
    trainer backend and the rollout engine, so a run's output says what trained what."""
    model_dir = Path(cfg.model.path or cfg.model.builtin_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    arch = ",".join(config.get("architectures", [])) or "unknown architecture"
    from areal_jobs.rollout.moe_serving import experts_in

    experts = experts_in(config)  # the config.json read above, not read again
    if experts:
        arch += f", mixture of experts: {experts} experts, top-{config.get('num_experts_per_tok', '?')}"
    return (
        f"policy: {model_dir} ({arch}); trainer: {cfg.trainer.backend.value}; "
        f"engine: {cfg.rollout.engine.value} x {cfg.rollout.num_servers}"
    )


def check_lora_serving(cfg: JobConfig) -> None:
    """model.lora.ship=adapter where this machine's engine cannot load adapters, or a mixture of
    experts it cannot serve, or routing replay of a dense model (rollout/moe_serving.py): before any
    process starts."""
    from areal_jobs.config import RoutingReplay
    from areal_jobs.rollout.lora_adapters import check_adapter_shipping
    from areal_jobs.rollout.moe_serving import check_moe_serving, check_routing_replay
    from areal_jobs.rollout.server import cuda_available

    try:
        check_adapter_shipping(cfg.rollout.engine, cfg.model.lora, cpu=not cuda_available())
        check_moe_serving(
            cfg.rollout.engine, cfg.model.path or cfg.model.builtin_dir, cpu=not cuda_available()
        )
        check_routing_replay(
            cfg.trainer.routing_replay is RoutingReplay.rollout,
            cfg.model.path or cfg.model.builtin_dir,
            cpu=not cuda_available(),
        )
    except ValueError as exc:
        raise SystemExit(f"invalid configuration: {exc}") from None


def check_trainer_kernels(cfg: JobConfig) -> None:
    """trainer.attention=varlen_attn / flex run on CUDA only: refused before any process starts
    where the trainer would run on the CPU (no GPU; trainer=torch, which trains on the CPU)."""
    from areal_jobs.config import TrainerBackend
    from areal_jobs.rollout.server import cuda_available
    from areal_jobs.trainer.forward.packed_attention import check_attention_device

    on_cuda = cfg.trainer.backend is not TrainerBackend.torch and cuda_available()
    try:
        check_attention_device(cfg.trainer.attention.value, "cuda" if on_cuda else None)
    except ValueError as exc:
        raise SystemExit(f"invalid configuration: {exc}") from None


def check_reward_model(cfg: JobConfig) -> None:
    """reward.source=model|combined: a reward model SGLang can serve as configured, before any
    process starts (rollout/reward_server.check_checkpoint)."""
    if cfg.reward.source is RewardSource.verifier:
        return
    from areal_jobs.rollout.reward_server import check_checkpoint

    try:
        check_checkpoint(cfg.reward.model)
    except ValueError as exc:
        raise SystemExit(f"invalid configuration: {exc}") from None


def check_reward_functions(cfg: JobConfig) -> JobConfig:
    """reward.function (and a mixture's function rewards): importable, the function there, one
    of the two signatures (launch/planning/reward_files.py), before anything is built or started.
    Returns the job with the files' absolute paths (the roles may run elsewhere)."""
    try:
        reward_files.check_functions(cfg)
    except ValueError as exc:
        raise SystemExit(f"invalid configuration: {exc}") from None
    return reward_files.absolute_paths(cfg, Path.cwd())
