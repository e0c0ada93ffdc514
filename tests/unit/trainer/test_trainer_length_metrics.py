"""The batch metrics the re-planner reads (launch/run/replanner.py): answer-length statistics per step,
prompt length, by hand."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
from test_trainer_batch import group

from areal_jobs.config import AlgoConfig
from areal_jobs.data.answer_lengths import LengthStats
from areal_jobs.trainer.intake.batch import assemble
from areal_jobs.trainer.loop import TrainLoop


def test_batch_metrics_carry_the_length_model_statistics():
    # two prompts (2 prompt tokens each): answers of 1 and 4 tokens, then 2 and 2
    groups = [group("g1", [[0], [0, 0, 0, 0]], [1.0, 0.0]), group("g2", [[0, 0], [0, 0]], [1.0, 0.0])]
    batch = assemble(groups, trainer_version=0, algo=AlgoConfig(batch_size=2, group_size=2))
    loop = SimpleNamespace(
        trained_tokens=0, max_staleness_seen=0, algo=AlgoConfig(batch_size=2, group_size=2)
    )
    got = TrainLoop._batch_metrics(loop, batch, groups)
    assert (got["gen/len_p50"], got["gen/len_max"], got["gen/prompt_len_mean"]) == (2.0, 4.0, 2.0)
    assert got["gen/len_p90"] == pytest.approx(3.4)  # numpy's linear interpolation: 2 + 0.7 * 2
    # every group's ln-lengths: {0, ln 4} and {ln 2, ln 2}; both means are ln 2
    assert got["gen/len_log_mean"] == pytest.approx(math.log(2))
    assert got["gen/len_log_var_within"] == pytest.approx(math.log(4) ** 2 / 2 / 2)  # (2 (ln 2)^2 + 0) / 2
    assert got["gen/len_log_var_between"] == pytest.approx(0.0)
    assert got["gen/len_group_size"] == 2.0
    assert LengthStats.from_metrics([got]) == LengthStats.of_groups([[1, 4], [2, 2]])


def test_length_stats_pool_steps_and_fit_the_prompt_spread():
    a = LengthStats.of_groups([[100, 100], [10_000, 10_000]])
    # no spread inside groups; group means ln 100 and ln 10^4 lie ln 10 either side of ln 1000
    assert (a.log_var_within, a.log_var_between) == (0.0, pytest.approx(math.log(10) ** 2))
    assert a.prompt_var == pytest.approx(math.log(10) ** 2)
    b = LengthStats.of_groups([[10, 1000]])  # one group: all spread inside, (2 (ln 10)^2) / 1
    assert b.log_var_within == pytest.approx(2 * math.log(10) ** 2) and b.prompt_var == 0.0
    pooled = LengthStats.from_metrics([a.metrics(), {"reward/mean": 1.0}, b.metrics()])
    assert pooled.log_var_within == pytest.approx(math.log(10) ** 2)  # mean of 0 and 2 (ln 10)^2
    assert LengthStats.from_metrics([{"reward/mean": 1.0}]) is None
    with pytest.raises(ValueError, match="non-empty group"):
        LengthStats.of_groups([[]])


def test_a_failed_reward_is_no_zero_in_the_reward_metrics():
    """A user function that raised (fn_error) or a reward model that gave no score leaves its
    sample out of training (trainer/intake/batch.py) and out of reward/mean and reward/accuracy too."""
    g = group("g1", [[0], [0], [0]], [1.0, 0.0, 0.0])
    g = replace(g, samples=(*g.samples[:2], replace(g.samples[2], reward_status="fn_error")))
    batch = assemble([g], trainer_version=0, algo=AlgoConfig(batch_size=1, group_size=3))
    loop = SimpleNamespace(
        trained_tokens=0, max_staleness_seen=0, algo=AlgoConfig(batch_size=1, group_size=3)
    )
    got = TrainLoop._batch_metrics(loop, batch, [g])
    assert (got["reward/mean"], got["reward/accuracy"]) == (0.5, 0.5)  # of the two scored samples
    assert got["reward/non_ok"] == 1.0 and got["batch/unscored_samples"] == 1.0
