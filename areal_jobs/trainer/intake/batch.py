"""From trajectory groups to a training batch: freshness check, advantages, per-sample arrays.

Pure: numpy only. The backends turn `TrainBatch` into packed tensors.
Per sample: input_ids [L] = prompt [p] + output [n]; behav_logprobs and versions are [n].
A multi-turn episode's output holds environment tokens too: its loss mask (1 on model tokens) is
ANDed with the truncation mask (algo.mask_truncated), so only the model's own tokens train.
A sample without a reward (api.UNSCORED_STATUSES: the reward model or a user's reward function failed) is left out: of its
group's advantages (the baseline is the scored samples') and of the batch; a group with no scored
sample is filtered.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from areal_jobs.api import UNSCORED_STATUSES, TrainBatch, TrainSample
from areal_jobs.config import AlgoConfig
from areal_jobs.staleness import is_fresh
from areal_jobs.trainer.objective.advantages import (
    group_advantages,
    is_uniform,
    overlong_penalty,
    shape_rewards,
    whiten,
)
from areal_jobs.transport.messages import TrajectoryGroup


def split_fresh(
    groups: list[TrajectoryGroup], trainer_version: int, max_staleness: int
) -> tuple[list[TrajectoryGroup], list[TrajectoryGroup]]:
    """(fresh, expired): expired groups hold a token older than the bound allows."""
    fresh = [g for g in groups if is_fresh(g.oldest_version, trainer_version, max_staleness)]
    expired = [g for g in groups if not is_fresh(g.oldest_version, trainer_version, max_staleness)]
    return fresh, expired


def assemble(
    groups: list[TrajectoryGroup], trainer_version: int, algo: AlgoConfig, max_new_tokens: int = 0
) -> TrainBatch:
    """Reward shaping and advantages per group, then one TrainSample per answer (optionally
    whitened over the batch). Groups must already be fresh. `max_new_tokens`: the rollout's
    length cap (overlong shaping, Dr.GRPO's normaliser)."""
    batch = TrainBatch(version=trainer_version, samples=[], group_ids=[], max_new_tokens=max_new_tokens)
    if algo.overlong_buffer and max_new_tokens <= algo.overlong_buffer:
        raise ValueError("algo.overlong_buffer must be < rollout.max_new_tokens")
    for g in groups:
        if not is_fresh(g.oldest_version, trainer_version, algo.max_staleness):
            raise AssertionError(f"group {g.group_id} is stale; split_fresh must run first")
        scored = [s for s in g.samples if s.reward_status not in UNSCORED_STATUSES]
        batch.unscored_samples += len(g.samples) - len(scored)
        rewards = np.array([s.reward for s in scored], dtype=np.float64)
        batch.group_ids.append(g.group_id)
        if not scored or (algo.filter_uniform_groups and is_uniform(rewards)):
            # the controller already replaces these (dynamic sampling); restored groups land here
            batch.filtered_group_ids.append(g.group_id)
            continue
        # AReaL's order: the overlong penalty on the raw reward, then bias, scale and clip
        shaped = shape_rewards(
            rewards
            - [
                overlong_penalty(s.num_tokens, max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
                for s in scored
            ],
            algo.reward_scaling,
            algo.reward_bias,
            algo.reward_clip,
        )
        advantages = group_advantages(shaped, algo.advantage, algo.adv_std, algo.adv_eps)
        prompt = g.prompt_ids.astype(np.int64)
        for s, adv, reward in zip(scored, advantages, shaped, strict=True):
            if s.num_tokens == 0:
                continue  # nothing to train on (e.g. the server stopped immediately)
            truncated = algo.mask_truncated and s.finish_reason == "length"
            # episode mask AND not truncated: None (all ones) stays None, as for a plain answer
            batch.samples.append(
                TrainSample(
                    sample_id=s.sample_id,
                    input_ids=np.concatenate([prompt, s.output_ids.astype(np.int64)]),
                    num_prompt_tokens=int(prompt.shape[0]),
                    behav_logprobs=s.logprobs.astype(np.float32),
                    versions=s.versions.astype(np.int32),
                    advantage=float(adv),
                    reward=float(reward),
                    loss_mask=np.zeros(s.num_tokens, np.uint8) if truncated else s.loss_mask,
                    routes=s.routes,
                )
            )
    if algo.adv_batch_norm and batch.samples:
        trained = np.array([float(s.mask().sum()) for s in batch.samples])
        white = whiten([s.advantage for s in batch.samples], trained, algo.adv_eps)
        batch.samples = [replace(s, advantage=float(a)) for s, a in zip(batch.samples, white, strict=True)]
    return batch
