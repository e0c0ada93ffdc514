"""Evaluation metrics against values worked out by hand (binomials written out below)."""

from __future__ import annotations

import pytest

from areal_jobs.rollout.eval_metrics import ProblemScores, greedy_accuracy, pass_at_k, sampled_metrics


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 1, 0.25),  # pass@1 = c/n
        (5, 2, 2, 1 - 3 / 10),  # C(3,2)=3, C(5,2)=10
        (10, 3, 5, 1 - 21 / 252),  # C(7,5)=21, C(10,5)=252
        (10, 0, 5, 0.0),  # nothing correct
        (4, 2, 3, 1.0),  # only 2 wrong: every 3 drawn hold a correct one
        (4, 4, 4, 1.0),
        (200, 1, 100, 0.5),  # C(199,100)/C(200,100) = 100/200
        (2000, 1, 1000, 0.5),  # same ratio at a size where C(2000,1000) overflows a float
    ],
)
def test_pass_at_k_matches_the_binomial_formula(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_sampled_metrics_average_problems_and_samples():
    problems = [
        # 4 samples, 1 correct; lengths 10, 20, 30, 40; the last one truncated
        ProblemScores([1.0, 0.0, 0.0, 0.0], [10, 20, 30, 40], [False, False, False, True]),
        # 4 samples, 3 correct (a reward of 0.5 is not correct)
        ProblemScores([1.0, 1.0, 1.0, 0.5], [5, 5, 5, 5], [False] * 4),
    ]
    got = sampled_metrics(problems, ks=(1, 2, 4))
    assert got.num_problems == 2 and got.samples_per_problem == 4
    assert got.pass_at_1 == pytest.approx((1 / 4 + 3 / 4) / 2)
    # pass@2: problem 1: 1 - C(3,2)/C(4,2) = 1 - 3/6; problem 2: 1 - C(1,2)/C(4,2) = 1
    assert got.pass_at_k[2] == pytest.approx((0.5 + 1.0) / 2)
    assert got.pass_at_k[4] == pytest.approx(1.0)
    assert got.pass_at_k[1] == pytest.approx(got.pass_at_1)
    assert got.mean_reward == pytest.approx((1.0 + 3.5) / 8)
    assert got.mean_length_tokens == pytest.approx((100 + 20) / 8)
    assert got.truncation_rate == pytest.approx(1 / 8)


def test_sampled_metrics_refuse_ragged_or_empty_input():
    with pytest.raises(ValueError):
        sampled_metrics([], ks=(1,))
    with pytest.raises(ValueError):
        sampled_metrics(
            [ProblemScores([1.0], [1], [False]), ProblemScores([1.0, 0.0], [1, 1], [False, False])], ks=(1,)
        )
    with pytest.raises(ValueError):
        sampled_metrics([ProblemScores([1.0], [1], [False])], ks=(2,))  # k > n
    with pytest.raises(ValueError):
        ProblemScores([1.0, 0.0], [1], [False])


def test_greedy_accuracy_counts_full_reward_only():
    assert greedy_accuracy([1.0, 0.0, 0.99, 1.0]) == 0.5
    with pytest.raises(ValueError):
        greedy_accuracy([])
