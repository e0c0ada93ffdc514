"""Hydra composition of conf/ over the ConfigStore schema: defaults, overrides, and clear errors."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from areal_jobs.config import (
    Advantage,
    JobConfig,
    PauseMode,
    RolloutEngine,
    TrainerBackend,
    load_job_config,
    register_configs,
    save_job_config,
    to_job_config,
)

CONF = str(Path(__file__).resolve().parents[3] / "conf")


def job(*overrides: str) -> JobConfig:
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return to_job_config(compose("config", overrides=list(overrides)))


def test_default_is_the_builtin_tiny_experiment_on_this_machine():
    cfg = job()
    assert cfg.model.path == "" and cfg.data.dataset.value == "arith"
    assert cfg.cluster.kind.value == "local" and cfg.trainer.backend is TrainerBackend.torch
    assert cfg.algo.advantage is Advantage.grpo and cfg.algo.max_staleness == 4


def test_shell_overrides_and_groups():
    cfg = job("algo.max_staleness=0", "algo=rloo", "rollout.pause_mode=in_place", "trainer.total_steps=7")
    assert cfg.algo.max_staleness == 0 and cfg.algo.advantage is Advantage.rloo
    assert cfg.rollout.pause_mode is PauseMode.in_place and cfg.trainer.total_steps == 7


def test_max_staleness_auto_from_the_command_line(tmp_path):
    cfg = job("algo.max_staleness=auto")
    assert cfg.algo.staleness_auto and cfg.algo.max_staleness == cfg.algo.staleness_ceiling == 8
    cfg = job("algo.max_staleness=auto", "algo.staleness_ceiling=16", "algo.staleness_drift=ess")
    assert cfg.algo.max_staleness == 16 and cfg.algo.staleness_drift.value == "ess"
    assert job("algo.max_staleness=2").algo.staleness_auto is False
    # the resolved config every role reads keeps the run auto (max_staleness holds the ceiling)
    save_job_config(cfg, tmp_path / "config.yaml")
    again = load_job_config(tmp_path / "config.yaml")
    assert again.algo.staleness_auto and again.algo.max_staleness == 16
    with pytest.raises(ValueError, match=r"algo\.exact_delay=-1"):
        job("algo.max_staleness=auto", "algo.exact_delay=8")
    with pytest.raises(ValueError, match=r"algo\.staleness_ceiling"):
        job("algo.max_staleness=auto", "algo.staleness_floor=8")
    with pytest.raises(ValueError, match=r"algo\.max_staleness=auto"):
        job("algo.staleness_auto=true", "algo.max_staleness=4")


def test_rollout_engine_is_a_config_group():
    assert job().rollout.engine is RolloutEngine.sglang
    assert job("rollout/engine=vllm").rollout.engine is RolloutEngine.vllm
    with pytest.raises(ConfigCompositionException):
        job("rollout/engine=tgi")


@pytest.mark.parametrize(
    "override, error",
    [
        ("algo.max_stalenes=4", ConfigCompositionException),  # misspelled key
        ("algo.staleness_drift=kl", ConfigCompositionException),  # not an Enum member
        ("rollout.pause_mode=rdma", ConfigCompositionException),  # not an Enum member
        ("trainer=jax", ConfigCompositionException),  # no such group option
    ],
)
def test_bad_overrides_are_rejected(override, error):
    with pytest.raises((error, ValidationError)):
        job(override)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("algo.max_staleness=-1", "algo.max_staleness"),
        # a wrong type: max_staleness is Any (int or auto), so __post_init__ refuses it by name
        ("algo.max_staleness=lots", "algo.max_staleness"),
        ("algo.max_staleness=1.5", "algo.max_staleness"),
        ("algo.group_size=1", "algo.group_size"),
        ("trainer.tp_size=2", "trainer=megatron"),
        ("data.dataset=gsm8k", "data.train_path"),
        ("rollout.kv_cache_gib=0", "rollout.kv_cache_gib"),
    ],
)
def test_cross_field_errors_name_the_override(override, fragment):
    with pytest.raises(ValueError, match=fragment.replace(".", r"\.")):
        job(override)


def test_fsdp_trainer_group_and_its_errors():
    cfg = job("trainer=fsdp", "trainer.dp_size=2", "trainer.fsdp_mixed_precision=true")
    assert (cfg.trainer.backend.value, cfg.trainer.dp_size, cfg.trainer.fsdp_mixed_precision) == (
        "fsdp",
        2,
        True,
    )
    assert cfg.cluster.placement.value == "auto"
    with pytest.raises(ValueError, match=r"trainer\.tp_size=1"):
        job("trainer=fsdp", "trainer.tp_size=2")
    with pytest.raises(Exception, match=r"cluster\.placement=halves"):  # Hydra names the bad Enum value
        job("cluster.placement=halves")


def test_recompute_and_attention_per_trainer_group():
    """trainer.recompute and trainer.attention in every trainer group; selective is Megatron's."""
    for group in ("torch", "fsdp", "megatron"):
        cfg = job(f"trainer={group}", "trainer.recompute=full", "trainer.attention=dense")
        assert (cfg.trainer.recompute.value, cfg.trainer.attention.value) == ("full", "dense")
        assert job(f"trainer={group}").trainer.attention.value == "varlen"
    assert job("trainer=megatron", "trainer.recompute=selective").trainer.recompute.value == "selective"
    for group in ("torch", "fsdp"):
        with pytest.raises(
            ValueError, match=r"trainer\.recompute=selective .*trainer=megatron.*trainer\.recompute=full"
        ):
            job(f"trainer={group}", "trainer.recompute=selective")
    with pytest.raises(Exception, match="fsdp_activation_checkpointing"):  # folded into trainer.recompute
        job("trainer=fsdp", "trainer.fsdp_activation_checkpointing=true")


def test_backend_refuses_knobs_it_does_not_implement():
    """issue 18: a knob a backend does not implement is refused naming the override and who has it."""
    from areal_jobs.config import AlgoConfig, JobConfig, TrainerBackend, TrainerConfig
    from areal_jobs.config.support import LIMITED, LIMITED_VALUES

    assert not LIMITED  # issue 26: minibatches and the reference KL run on every backend
    cases = list(LIMITED_VALUES)
    assert ("prox_logp", "loglinear") in cases
    for name, value in cases:
        algo = AlgoConfig(decoupled=True, **{name: value})  # loglinear: decoupled PPO's proximal policy
        JobConfig(algo=algo)  # torch implements it
        with pytest.raises(
            ValueError, match=rf"algo.{name}={value} is not implemented by trainer=megatron.*trainer=torch"
        ):
            JobConfig(algo=algo, trainer=TrainerConfig(backend=TrainerBackend.megatron))


def test_every_backend_accepts_minibatches_the_reference_kl_and_the_new_knobs():
    """issue 26: nothing of these is refused any more, on any backend."""
    from areal_jobs.config import AlgoConfig, JobConfig, TrainerBackend, TrainerConfig
    from areal_jobs.config.algo import ImportanceLevel

    algo = AlgoConfig(
        ppo_minibatches=4, kl_coef=0.1, importance_level=ImportanceLevel.sequence, entropy_coef=0.01,
        reward_scaling=10.0, reward_bias=-0.5, reward_clip=5.0,
    )  # fmt: skip
    for trainer in (
        TrainerConfig(),
        TrainerConfig(backend=TrainerBackend.fsdp, dp_size=2),
        TrainerConfig(backend=TrainerBackend.megatron, tp_size=2, dp_size=2),
    ):
        JobConfig(algo=algo, trainer=trainer)
