"""Batch assembly: freshness split, advantages per group, per-token staleness."""

from dataclasses import replace

import numpy as np
import pytest

from areal_jobs.config import Advantage, AlgoConfig
from areal_jobs.trainer.intake.batch import assemble, split_fresh
from areal_jobs.transport import messages as m


def group(gid, versions_per_sample, rewards, finish=None):
    samples = tuple(
        m.SampleTrajectory(
            sample_id=f"{gid}/{i}",
            output_ids=np.arange(len(v), dtype=np.int32) + 10,
            logprobs=np.full(len(v), -1.0, dtype=np.float32),
            versions=np.asarray(v, dtype=np.int32),
            reward=r,
            reward_status="ok",
            finish_reason=(finish or {}).get(i, "stop"),
            num_interruptions=0,
        )
        for i, (v, r) in enumerate(zip(versions_per_sample, rewards))
    )
    return m.TrajectoryGroup(gid, int(gid[1:]), np.array([1, 2], dtype=np.int32), samples)


def test_split_fresh_uses_the_oldest_token():
    g_ok = group("g1", [[5, 6], [6]], [1.0, 0.0])
    g_old = group("g2", [[6, 6], [2, 6]], [1.0, 0.0])
    fresh, expired = split_fresh([g_ok, g_old], trainer_version=6, max_staleness=2)
    assert [g.group_id for g in fresh] == ["g1"] and [g.group_id for g in expired] == ["g2"]


def test_assemble_builds_prompt_plus_output_and_advantages():
    algo = AlgoConfig(batch_size=2, group_size=2, max_staleness=4, advantage=Advantage.drgrpo)
    batch = assemble([group("g1", [[3, 3, 4], [4]], [1.0, 0.0])], trainer_version=5, algo=algo)
    assert batch.group_ids == ["g1"]
    s0, s1 = batch.samples
    assert s0.input_ids.tolist() == [1, 2, 10, 11, 12] and s0.num_prompt_tokens == 2
    assert s0.advantage == pytest.approx(0.5) and s1.advantage == pytest.approx(-0.5)
    assert batch.num_output_tokens == 4
    assert batch.staleness().tolist() == [2, 2, 1, 1]


def test_uniform_groups_filtered_when_asked():
    algo = AlgoConfig(batch_size=2, group_size=2, filter_uniform_groups=True)
    batch = assemble([group("g1", [[1], [1]], [1.0, 1.0]), group("g2", [[1], [1]], [0.0, 1.0])], 1, algo)
    assert batch.filtered_group_ids == ["g1"]
    assert [s.sample_id for s in batch.samples] == ["g2/0", "g2/1"]


def test_stale_group_is_an_invariant_violation():
    algo = AlgoConfig(batch_size=1, group_size=2, max_staleness=0)
    with pytest.raises(AssertionError):
        assemble([group("g1", [[1], [2]], [1.0, 0.0])], trainer_version=2, algo=algo)


def test_overlong_shaping_and_mask_truncated():
    # max_new_tokens 4, buffer 2: a 3-token answer loses 0.5 * 1.0, a 4-token one (cut) the full 1.0
    algo = AlgoConfig(
        batch_size=1, group_size=3, advantage=Advantage.drgrpo, overlong_buffer=2, mask_truncated=True
    )
    g = group("g1", [[1], [1, 1, 1], [1, 1, 1, 1]], [1.0, 1.0, 1.0], finish={2: "length"})
    batch = assemble([g], 1, algo, max_new_tokens=4)
    assert [s.reward for s in batch.samples] == pytest.approx([1.0, 0.5, 0.0])
    # Dr.GRPO advantages of the shaped rewards: mean 0.5
    assert [s.advantage for s in batch.samples] == pytest.approx([0.5, 0.0, -0.5])
    assert batch.samples[0].loss_mask is None and batch.samples[2].mask().tolist() == [0, 0, 0, 0]
    assert batch.max_new_tokens == 4


def test_batch_whitening_in_assemble():
    algo = AlgoConfig(batch_size=1, group_size=2, advantage=Advantage.drgrpo, adv_batch_norm=True)
    batch = assemble([group("g1", [[1, 1, 1], [1]], [1.0, -1.0])], 1, algo)
    # advantages 1 (3 tokens), -1 (1 token): token mean 0.5, unbiased token std 1
    assert [s.advantage for s in batch.samples] == pytest.approx([0.5 / (1 + 1e-5), -1.5 / (1 + 1e-5)])


def episode(gid, mask, finish="stop", reward=1.0):
    n = len(mask)
    return m.SampleTrajectory(
        f"{gid}/0", np.arange(n, dtype=np.int32) + 10, np.where(np.array(mask) == 1, -1.0, 0.0).astype(np.float32),
        np.full(n, 3, np.int32), reward, "ok", finish, 0, loss_mask=np.array(mask, np.uint8), num_turns=2,
    )  # fmt: skip


def test_an_episode_trains_only_its_model_tokens_and_truncation_masks_it_all():
    # model 2 tokens, user 2 tokens, model 1 token; the truncated episode trains nothing
    done = episode("g1", [1, 1, 0, 0, 1])
    cut = episode("g1", [1, 1, 0, 0, 1], finish="length", reward=0.0)
    g = m.TrajectoryGroup("g1", 1, np.array([1, 2], np.int32), (done, replace(cut, sample_id="g1/1")))
    batch = assemble([g], trainer_version=3, algo=AlgoConfig(batch_size=1, group_size=2, mask_truncated=True))
    assert batch.samples[0].mask().tolist() == [1, 1, 0, 0, 1]
    assert batch.samples[1].mask().tolist() == [0, 0, 0, 0, 0]
    assert batch.samples[0].input_ids.tolist() == [1, 2, 10, 11, 12, 13, 14]
    kept = assemble([g], trainer_version=3, algo=AlgoConfig(batch_size=1, group_size=2, mask_truncated=False))
    assert kept.samples[1].mask().tolist() == [1, 1, 0, 0, 1]


def test_samples_without_a_reward_are_left_out_of_advantages_and_batch():
    """A failed reward-model score (model_error) is no 0: the group's baseline is its scored
    samples', the unscored one trains nothing, and a group with none scored is filtered."""
    algo = AlgoConfig(batch_size=2, group_size=3, advantage=Advantage.drgrpo)
    g = group("g1", [[1], [1], [1]], [1.0, 0.0, 0.0])
    g = replace(g, samples=(g.samples[0], replace(g.samples[1], reward_status="model_error"), g.samples[2]))
    none = group("g2", [[1], [1]], [0.0, 0.0])
    none = replace(none, samples=tuple(replace(s, reward_status="model_error") for s in none.samples))
    batch = assemble([g, none], trainer_version=1, algo=algo)
    assert [s.sample_id for s in batch.samples] == ["g1/0", "g1/2"]
    # mean over the two scored rewards (1, 0) is 0.5; with the failed one counted as 0 it would be 1/3
    assert [s.advantage for s in batch.samples] == [pytest.approx(0.5), pytest.approx(-0.5)]
    assert batch.filtered_group_ids == ["g2"] and batch.unscored_samples == 3
