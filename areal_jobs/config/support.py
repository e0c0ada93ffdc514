"""Which trainer backend implements which objective knob: the one table the config validation
and the backend contract test (tests/integration/contract/) both read.

Every `AlgoConfig` field is either implemented by every backend, or listed in `LIMITED` with the
backends that implement a non-default value, or one of its values is listed in `LIMITED_VALUES`
with the backends that implement that value. A non-default value on another backend is refused
when the config is validated (never silently ignored).
"""

from __future__ import annotations

from dataclasses import fields
from enum import Enum

from areal_jobs.config.algo import AlgoConfig
from areal_jobs.config.lora import LoraConfig
from areal_jobs.config.trainer import TrainerBackend

# field -> backends that implement values other than the default. Empty since issue 26: every
# backend runs algo.ppo_minibatches > 1 and keeps a reference model for algo.kl_coef > 0
LIMITED: dict[str, tuple[str, ...]] = {}

# (field, value) -> backends that implement that value, for fields whose values differ in support
LIMITED_VALUES: dict[tuple[str, str], tuple[str, ...]] = {
    # loglinear needs the per-token versions and the version in the loss of every micro-batch;
    # only the torch backend carries them there (current and recompute: every backend)
    ("prox_logp", "loglinear"): ("torch",),
}


# model.lora.rank > 0 (LoRA): the backends that train adapters. Megatron-Core has no LoRA of its
# own; its PEFT lives in Megatron-Bridge, which needs Transformer Engine (not on CPU:
# shared/reference/megatron-cpu.md), and our conversion maps full weights only.
LORA_BACKENDS: tuple[str, ...] = ("torch", "fsdp")


def check_lora_support(lora: LoraConfig, backend: TrainerBackend) -> None:
    if lora.enabled and backend.value not in LORA_BACKENDS:
        raise ValueError(
            f"model.lora.rank={lora.rank} is not implemented by trainer={backend.value}; "
            f"trainer={'/'.join(LORA_BACKENDS)} implements it (or leave model.lora.rank=0)"
        )


def check_backend_support(algo: AlgoConfig, backend: TrainerBackend) -> None:
    """Raise ValueError naming the override and the backends that support it."""
    defaults = AlgoConfig()
    for name, backends in LIMITED.items():
        value, default = getattr(algo, name), getattr(defaults, name)
        if value != default and backend.value not in backends:
            raise ValueError(
                f"algo.{name}={_shown(value)} is not implemented by trainer={backend.value}; "
                f"trainer={'/'.join(backends)} implements it (or leave algo.{name}={_shown(default)})"
            )
    for (name, value), backends in LIMITED_VALUES.items():
        if _shown(getattr(algo, name)) == value and backend.value not in backends:
            raise ValueError(
                f"algo.{name}={value} is not implemented by trainer={backend.value}; "
                f"trainer={'/'.join(backends)} implements it (or leave algo.{name}={_shown(getattr(defaults, name))})"
            )


def _shown(value: object) -> object:
    """An Enum as the override spells it (loglinear, not ProxLogp.loglinear)."""
    return value.value if isinstance(value, Enum) else value


def algo_field_names() -> list[str]:
    return [f.name for f in fields(AlgoConfig)]
