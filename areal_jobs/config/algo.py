"""The RL objective: staleness bound, batch shape, advantages and the PPO loss."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Advantage(enum.Enum):
    grpo = "grpo"  # (r - mean) / (std + eps) within the group
    drgrpo = "drgrpo"  # r - mean (Dr.GRPO: no std normalisation)
    rloo = "rloo"  # r - mean of the other G-1 samples


@dataclass
class AlgoConfig:
    """Staleness-bounded decoupled PPO (AReaL)."""

    max_staleness: int = 4  # eta: max policy versions between sampling a token and training on it
    batch_size: int = 8  # B: prompt groups per training step
    group_size: int = 8  # G: sampled answers per prompt
    advantage: Advantage = Advantage.grpo
    clip_eps: float = 0.2  # PPO clip on r = exp(logp - prox_logp)
    decoupled: bool = True  # False: proximal = behaviour log-probs (standard PPO ablation)
    behav_weight_cap: float = 0.0  # >0: drop tokens whose exp(prox - behav) exceeds it
    filter_uniform_groups: bool = False  # drop groups whose rewards are all equal (no signal)
    ppo_minibatches: int = 1  # optimiser steps per batch; the clip keeps later ones near the proximal policy

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError("algo.max_staleness must be >= 0 (0 = synchronous)")
        if self.batch_size < 1:
            raise ValueError("algo.batch_size must be >= 1")
        if self.group_size < 2 and self.advantage is not Advantage.drgrpo:
            raise ValueError(
                f"algo.advantage={self.advantage.value} normalises within a group: set "
                "algo.group_size>=2 or algo.advantage=drgrpo"
            )
        if not 0.0 < self.clip_eps < 1.0:
            raise ValueError("algo.clip_eps must be in (0, 1)")
        if not 1 <= self.ppo_minibatches <= self.batch_size * self.group_size:
            raise ValueError("algo.ppo_minibatches must be in [1, algo.batch_size * algo.group_size]")
