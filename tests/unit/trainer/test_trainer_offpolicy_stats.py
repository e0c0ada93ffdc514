"""offpolicy/*: the staleness mechanism metrics (trainer/objective/loss_stats.py) by hand-worked values,
their reduction over micro-batches and ranks, and which π_pre each objective measures."""

import math

import numpy as np
import pytest
import torch

from areal_jobs.config.algo import AlgoConfig, ProxLogp
from areal_jobs.trainer.objective.loss import ppo_loss, pre_step_logp
from areal_jobs.trainer.objective.loss_stats import HIST_BINS, HIST_EDGES, LossStats, hist_quantile

ALGO = dict(batch_size=4, group_size=4)
# log w = log π_pre - b per token, and the advantages; the last token is masked (its huge
# log w must not count anywhere)
LOG_W = [0.5, -0.5, 0.1, -0.3, 0.0, 1.0, 15.0]
ADV = [1.0, -1.0, 1.0, -1.0, 0.0, -1.0, 1.0]
MASK = [1, 1, 1, 1, 1, 1, 0]


def stats_of(log_w, adv, mask, pre_known=True, **algo):
    pre = torch.zeros(len(log_w), dtype=torch.float64)
    behav = -torch.tensor(log_w, dtype=torch.float64)
    weight = torch.tensor(mask, dtype=torch.float64) / max(sum(mask), 1)
    _, stats = ppo_loss(
        pre.clone(), pre, behav, torch.tensor(adv, dtype=torch.float64), weight,
        torch.zeros(len(log_w), dtype=torch.int64), AlgoConfig(**ALGO, **algo),
        pre_logp=pre if pre_known else None,
    )  # fmt: skip
    return stats


def test_hand_worked_values():
    # clip 0.2: w must stay in [0.8, 1.2]. w = e^0.5 1.65 out, e^-0.5 0.61 out, e^0.1 1.11 in,
    # e^-0.3 0.74 out, 1 in, e^1 2.72 out: 4 of 6 outside. A > 0: tokens 0, 2 (1 outside);
    # A < 0: tokens 1, 3, 5 (all outside). Naive's clip cuts A > 0 with w > 1.2 (token 0) and
    # A < 0 with w < 0.8 (tokens 1, 3), not token 5 (A < 0, w > 1.2: its unclipped branch wins).
    m = stats_of(LOG_W, ADV, MASK).to_metrics()
    logs = LOG_W[:6]
    w = [math.exp(x) for x in logs]
    assert m["offpolicy/measured_fraction"] == 1.0
    assert m["offpolicy/preclip_fraction"] == pytest.approx(4 / 6)
    assert m["offpolicy/preclip_fraction_adv_pos"] == pytest.approx(1 / 2)
    assert m["offpolicy/preclip_fraction_adv_neg"] == pytest.approx(3 / 3)
    assert m["offpolicy/preclip_cut_fraction"] == pytest.approx(3 / 6)
    assert m["offpolicy/k3_kl"] == pytest.approx(sum(x - 1 - math.log(x) for x in w) / 6, rel=1e-12)
    assert m["offpolicy/abs_log_w_mean"] == pytest.approx(2.4 / 6, rel=1e-12)
    assert m["offpolicy/abs_log_w_max"] == pytest.approx(1.0, rel=1e-12)
    assert m["offpolicy/ess"] == pytest.approx(sum(w) ** 2 / (6 * sum(x * x for x in w)), rel=1e-12)
    # p99 of six values is the largest, 1.0: reported as the upper edge of 1.0's bin
    assert 1.0 <= m["offpolicy/abs_log_w_p99"] <= 1.0 * 1.0124


def test_clip_higher_moves_the_upper_bound():
    # eps_clip_high 0.7: w = e^0.5 = 1.65 is inside [0.8, 1.7], e^1 = 2.72 still outside
    m = stats_of(LOG_W, ADV, MASK, eps_clip_high=0.7).to_metrics()
    assert m["offpolicy/preclip_fraction"] == pytest.approx(3 / 6)
    assert m["offpolicy/preclip_cut_fraction"] == pytest.approx(2 / 6)


def test_equal_weights_have_full_ess_and_no_preclip():
    m = stats_of([0.0] * 4, [1.0, -1.0, 1.0, -1.0], [1] * 4).to_metrics()
    assert m["offpolicy/ess"] == pytest.approx(1.0) and m["offpolicy/preclip_fraction"] == 0.0
    assert m["offpolicy/k3_kl"] == 0.0 and m["offpolicy/abs_log_w_p99"] <= HIST_EDGES[1]


def test_unknown_pre_step_policy_measures_nothing():
    stats = stats_of(LOG_W, ADV, MASK, pre_known=False)
    m = stats.to_metrics()
    assert stats.pre_tokens == 0 and m["offpolicy/measured_fraction"] == 0.0
    assert m["offpolicy/preclip_fraction"] == 0.0 and m["offpolicy/ess"] == 1.0
    assert stats.pre_abs_log_w_hist.sum() == 0


def test_p99_from_the_histogram_is_within_one_bin_of_the_exact_quantile():
    values = np.random.default_rng(0).lognormal(mean=-3.0, sigma=1.5, size=10_000)
    hist, exact = np.zeros(HIST_BINS), np.sort(values)[int(math.ceil(0.99 * len(values))) - 1]
    hist += np.bincount(np.searchsorted(HIST_EDGES[1:-1], values, side="right"), minlength=HIST_BINS)
    p99 = hist_quantile(hist, 0.99)
    assert exact <= p99 <= exact * (HIST_EDGES[2] / HIST_EDGES[1]) * (1 + 1e-12)


def test_micro_batches_and_ranks_reduce_to_the_whole():
    """Two halves added (and sent through sums()/maxes() as the backends' all-reduces do) give
    the statistics of the whole: sums add, the histogram's counts add exactly, the max is the max."""
    g = torch.Generator().manual_seed(3)
    log_w = (0.3 * torch.randn(40, generator=g, dtype=torch.float64)).tolist()
    adv = torch.randn(40, generator=g, dtype=torch.float64).tolist()
    whole = stats_of(log_w, adv, [1] * 40)
    a, b = stats_of(log_w[:25], adv[:25], [1] * 25), stats_of(log_w[25:], adv[25:], [1] * 15)
    summed = LossStats()
    summed.add(a)
    summed.add(b)
    reduced = LossStats.from_reduced(a.sums() + b.sums(), np.maximum(a.maxes(), b.maxes()))
    for got in (summed, reduced):
        np.testing.assert_array_equal(got.pre_abs_log_w_hist, whole.pre_abs_log_w_hist)
        assert got.pre_abs_log_w_max == whole.pre_abs_log_w_max
        for key, value in whole.to_metrics().items():
            if key.startswith("offpolicy/"):
                assert got.to_metrics()[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key


@pytest.mark.parametrize(
    "decoupled, prox, first, expect",
    [
        (True, ProxLogp.current, False, "prox"),
        (True, ProxLogp.recompute, True, "prox"),
        (True, ProxLogp.loglinear, True, "logp"),
        (True, ProxLogp.loglinear, False, None),
        (False, ProxLogp.current, True, "logp"),
        (False, ProxLogp.current, False, None),
    ],
)
def test_which_pre_step_log_probs_each_objective_has(decoupled, prox, first, expect):
    """π_pre without an extra forward pass: the proximal log-probs where they are the pre-step
    policy's, else the first minibatch's own gradient pass (run with the pre-step weights)."""
    algo = AlgoConfig(**ALGO, decoupled=decoupled, prox_logp=prox)
    p, theta = torch.zeros(3), torch.ones(3, requires_grad=True)
    got = pre_step_logp(algo, p, theta, first_minibatch=first)
    if expect is None:
        assert got is None
    elif expect == "prox":
        assert got is p
    else:
        assert torch.equal(got, theta.detach()) and not got.requires_grad
