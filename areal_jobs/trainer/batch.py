"""From trajectory groups to a training batch: freshness check, advantages, per-sample arrays.

Pure: numpy only. The backends turn `TrainBatch` into packed tensors.
Per sample: input_ids [L] = prompt [p] + output [n]; behav_logprobs and versions are [n].
"""

from __future__ import annotations

import numpy as np

from areal_jobs.api import TrainBatch, TrainSample
from areal_jobs.config import AlgoConfig
from areal_jobs.data.staleness import is_fresh
from areal_jobs.trainer.advantages import group_advantages, is_uniform
from areal_jobs.transport.messages import TrajectoryGroup


def split_fresh(
    groups: list[TrajectoryGroup], trainer_version: int, max_staleness: int
) -> tuple[list[TrajectoryGroup], list[TrajectoryGroup]]:
    """(fresh, expired): expired groups hold a token older than the bound allows."""
    fresh = [g for g in groups if is_fresh(g.oldest_version, trainer_version, max_staleness)]
    expired = [g for g in groups if not is_fresh(g.oldest_version, trainer_version, max_staleness)]
    return fresh, expired


def assemble(groups: list[TrajectoryGroup], trainer_version: int, algo: AlgoConfig) -> TrainBatch:
    """Advantages per group, then one TrainSample per answer. Groups must already be fresh."""
    batch = TrainBatch(version=trainer_version, samples=[], group_ids=[])
    for g in groups:
        if not is_fresh(g.oldest_version, trainer_version, algo.max_staleness):
            raise AssertionError(f"group {g.group_id} is stale; split_fresh must run first")
        rewards = np.array([s.reward for s in g.samples], dtype=np.float64)
        batch.group_ids.append(g.group_id)
        if algo.filter_uniform_groups and is_uniform(rewards):
            batch.filtered_group_ids.append(g.group_id)
            continue
        advantages = group_advantages(rewards, algo.advantage)
        prompt = g.prompt_ids.astype(np.int64)
        for s, adv in zip(g.samples, advantages):
            if s.num_tokens == 0:
                continue  # nothing to train on (e.g. the server stopped immediately)
            batch.samples.append(
                TrainSample(
                    sample_id=s.sample_id,
                    input_ids=np.concatenate([prompt, s.output_ids.astype(np.int64)]),
                    num_prompt_tokens=int(prompt.shape[0]),
                    behav_logprobs=s.logprobs.astype(np.float32),
                    versions=s.versions.astype(np.int32),
                    advantage=float(adv),
                    reward=float(s.reward),
                )
            )
    return batch
