"""The PPO loss against a scalar, branch-by-branch reference (float64), loss AND gradient, for
every switch of AlgoConfig that changes the loss; plus hand-worked numbers for each switch."""

import math

import numpy as np
import pytest
import torch

from areal_jobs.config.algo import AlgoConfig, BehavWeightMode, KLEstimator, LossAgg
from areal_jobs.trainer.objective.loss import LossStats, ppo_loss, token_weights

ALGO = dict(batch_size=4, group_size=4)


def reference(theta, prox, behav, adv, weight, seqs, algo: AlgoConfig):
    """(loss, d loss / d theta per token): one token at a time, straight from the definitions."""
    lo, hi = 1 - algo.clip_eps, 1 + (algo.eps_clip_high or algo.clip_eps)
    seq_out = set()
    if algo.behav_weight_mode is BehavWeightMode.seq_mask:
        for s in set(seqs):
            logs = [p - b for p, b, w, q in zip(prox, behav, weight, seqs) if q == s and w > 0]
            if logs and not algo.mis_low <= math.exp(sum(logs) / len(logs)) <= algo.mis_high:
                seq_out.add(s)
    loss, grad = 0.0, []
    for t, p, b, a, wt, q in zip(theta, prox, behav, adv, weight, seqs):
        r, w = math.exp(t - p), math.exp(p - b)
        mode, cap = algo.behav_weight_mode, algo.behav_weight_cap
        if mode is BehavWeightMode.drop and cap > 0 and w > cap:
            w = 0.0
        if mode is BehavWeightMode.truncate:
            w = min(w, cap)
        if q in seq_out:
            w = 0.0
        unclipped, clipped = -a * r, -a * min(max(r, lo), hi)
        if unclipped >= clipped:
            term, d = unclipped, -a * r
        else:
            term, d = clipped, 0.0
        if algo.dual_clip_c > 0 and a < 0 and term > -algo.dual_clip_c * a:
            term, d = -algo.dual_clip_c * a, 0.0
        loss += wt * w * term
        grad.append(wt * w * d)
    return loss, grad


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    theta = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    prox = theta + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    behav = prox + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return theta, prox, behav, adv


def layout(lengths, masked=()):
    """Per-token seq index and mask for samples of `lengths`; `masked`: flat token indices."""
    seqs = np.repeat(np.arange(len(lengths)), lengths)
    masks = [np.ones(n) for n in lengths]
    for i in masked:
        s = int(seqs[i])
        masks[s][i - sum(lengths[:s])] = 0
    return torch.as_tensor(seqs), masks


CASES = {
    "default": {},
    "clip_higher": dict(eps_clip_high=0.28),
    "dual_clip": dict(dual_clip_c=1.5),
    "drop_cap": dict(behav_weight_cap=1.2),
    "truncate": dict(behav_weight_mode=BehavWeightMode.truncate, behav_weight_cap=1.2),
    "seq_mask": dict(behav_weight_mode=BehavWeightMode.seq_mask, mis_low=0.8, mis_high=1.25),
    "seq_mean_token_mean": dict(loss_agg=LossAgg.seq_mean_token_mean),
    "seq_mean_token_sum": dict(loss_agg=LossAgg.seq_mean_token_sum),
    "drgrpo_norm": dict(loss_agg=LossAgg.seq_mean_token_sum_norm),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_match_the_scalar_reference(case, seed):
    algo = AlgoConfig(**ALGO, **CASES[case])
    lengths = [5, 1, 9, 3, 12]
    theta, prox, behav, adv = tokens(sum(lengths), seed)
    seqs, masks = layout(lengths, masked=(2, 3, 5, 20))  # sample 1 (one token) is fully masked
    weight = torch.as_tensor(np.concatenate(token_weights(masks, algo.loss_agg, max_new_tokens=16)))
    th = theta.clone().requires_grad_()
    loss, stats = ppo_loss(th, prox, behav, adv, weight, seqs, algo)
    loss.backward()
    expected, grad = reference(
        theta.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), weight.tolist(), seqs.tolist(), algo
    )
    assert float(loss) == pytest.approx(expected, rel=1e-12, abs=1e-14)
    np.testing.assert_allclose(th.grad.numpy(), grad, rtol=1e-12, atol=1e-14)
    assert th.grad[[2, 3, 5, 20]].abs().sum() == 0  # masked tokens get no gradient
    assert stats.num_tokens == sum(lengths) - 4 and stats.num_seqs == 4


def test_aggregation_weights_by_hand():
    masks = [np.array([1, 1, 0]), np.array([0.0]), np.array([1, 1, 1, 1])]  # 2 + 0 + 4 valid tokens
    w = token_weights(masks, LossAgg.token_mean)
    assert w[0].tolist() == pytest.approx([1 / 6, 1 / 6, 0]) and w[1].tolist() == [0]
    w = token_weights(masks, LossAgg.seq_mean_token_mean)  # two non-empty samples
    assert w[0].tolist() == pytest.approx([1 / 4, 1 / 4, 0]) and w[2].tolist() == pytest.approx([1 / 8] * 4)
    w = token_weights(masks, LossAgg.seq_mean_token_sum)
    assert w[2].tolist() == pytest.approx([1 / 2] * 4)
    w = token_weights(masks, LossAgg.seq_mean_token_sum_norm, max_new_tokens=10)  # 3 samples x 10
    assert w[0].tolist() == pytest.approx([1 / 30, 1 / 30, 0]) and w[2].tolist() == pytest.approx(
        [1 / 30] * 4
    )
    with pytest.raises(ValueError, match="max_new_tokens"):
        token_weights(masks, LossAgg.seq_mean_token_sum_norm)


def one_token(theta, prox, behav, adv, **algo):
    th = torch.tensor([theta], dtype=torch.float64, requires_grad=True)
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    loss, stats = ppo_loss(
        th, t(prox), t(behav), t(adv), t(1.0), torch.tensor([0]), AlgoConfig(**ALGO, **algo)
    )
    loss.backward()
    return float(loss), float(th.grad), stats


def test_hand_worked_clip_higher_and_dual_clip():
    r = math.log(1.25)  # θ - p: ratio 1.25, A = 2
    assert one_token(r, 0.0, 0.0, 2.0)[:2] == pytest.approx((-2.4, 0.0))  # clipped at 1.2, no gradient
    assert one_token(r, 0.0, 0.0, 2.0, eps_clip_high=0.28)[:2] == pytest.approx((-2.5, -2.5))
    big = math.log(5.0)  # ratio 5, A = -1: PPO loss 5, dual clip c = 3 holds it at 3 with no gradient
    assert one_token(big, 0.0, 0.0, -1.0)[:2] == pytest.approx((5.0, 5.0))
    loss, grad, stats = one_token(big, 0.0, 0.0, -1.0, dual_clip_c=3.0)
    assert (loss, grad, stats.dual_clipped_tokens) == pytest.approx((3.0, 0.0, 1.0))
    assert one_token(big, 0.0, 0.0, 1.0, dual_clip_c=3.0)[:2] == pytest.approx(
        (-1.2, 0.0)
    )  # A > 0: untouched


def test_hand_worked_behaviour_weight_modes():
    w = math.log(2.0)  # p - b: w = 2, ratio 1, A = 1: plain loss -2, gradient -2
    assert one_token(0.0, 0.0, -w, 1.0)[:2] == pytest.approx((-2.0, -2.0))
    loss, grad, stats = one_token(0.0, 0.0, -w, 1.0, behav_weight_cap=1.5)  # drop
    assert (loss, grad, stats.affected_tokens, stats.num_tokens) == (0.0, 0.0, 1.0, 1.0)
    loss, grad, _ = one_token(
        0.0, 0.0, -w, 1.0, behav_weight_mode=BehavWeightMode.truncate, behav_weight_cap=1.5
    )
    assert (loss, grad) == pytest.approx((-1.5, -1.5))
    # seq_mask: sample 0 has log w = log 2, log 0.5 (geometric mean 1: kept); sample 1 log 3 (masked)
    theta = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    prox = torch.zeros(3, dtype=torch.float64)
    behav = -torch.tensor([math.log(2), math.log(0.5), math.log(3)], dtype=torch.float64)
    algo = AlgoConfig(**ALGO, behav_weight_mode=BehavWeightMode.seq_mask, mis_low=0.5, mis_high=2.0)
    loss, stats = ppo_loss(
        theta,
        prox,
        behav,
        torch.ones(3, dtype=torch.float64),
        torch.full((3,), 1 / 3, dtype=torch.float64),
        torch.tensor([0, 0, 1]),
        algo,
    )
    assert float(loss) == pytest.approx(-(2 + 0.5) / 3)
    assert (stats.affected_tokens, stats.affected_seqs, stats.num_seqs) == (1.0, 1.0, 2.0)


@pytest.mark.parametrize(
    ("estimator", "value", "slope"),
    [
        (KLEstimator.k1, lambda x: x, lambda x: 1.0),
        (KLEstimator.k2, lambda x: x * x / 2, lambda x: x),
        (KLEstimator.k3, lambda x: math.exp(-x) - 1 + x, lambda x: 1 - math.exp(-x)),
    ],
)
def test_kl_to_reference_adds_the_estimator(estimator, value, slope):
    x = 0.3  # θ - ref, with θ = p = b and A = 0: the PPO term is 0
    theta = torch.tensor([x], dtype=torch.float64, requires_grad=True)
    zero = torch.zeros(1, dtype=torch.float64)
    algo = AlgoConfig(**ALGO, kl_coef=0.1, kl_estimator=estimator)
    loss, stats = ppo_loss(
        theta,
        theta.detach(),
        theta.detach(),
        zero,
        torch.ones(1, dtype=torch.float64),
        torch.tensor([0]),
        algo,
        ref_logp=zero,
    )
    loss.backward()
    assert float(loss) == pytest.approx(0.1 * value(x), rel=1e-12)
    assert float(theta.grad) == pytest.approx(0.1 * slope(x), rel=1e-12)
    assert stats.kl_ref_sum == pytest.approx(value(x))
    with pytest.raises(ValueError, match="reference"):
        ppo_loss(theta, zero, zero, zero, torch.ones(1, dtype=torch.float64), torch.tensor([0]), algo)


def test_mismatch_and_entropy_metrics_by_hand():
    # p - b = 0.5 and -0.5 on two tokens of one sample: mean |p-b| 0.5,
    # k3 = w - 1 - log w: (e^0.5 - 1.5 + e^-0.5 - 0.5) / 2
    prox = torch.zeros(2, dtype=torch.float64)
    behav = torch.tensor([-0.5, 0.5], dtype=torch.float64)
    _, stats = ppo_loss(
        prox.clone(),
        prox,
        behav,
        torch.ones(2, dtype=torch.float64),
        torch.full((2,), 0.5, dtype=torch.float64),
        torch.tensor([0, 0]),
        AlgoConfig(**ALGO),
        entropy=torch.tensor([1.0, 3.0]),
    )
    metrics = stats.to_metrics()
    assert metrics["mismatch/abs_diff_mean"] == pytest.approx(0.5)
    assert metrics["mismatch/k3_kl"] == pytest.approx((math.exp(0.5) - 1.5 + math.exp(-0.5) - 0.5) / 2)
    assert metrics["ppo/entropy"] == pytest.approx(2.0)
    assert metrics["mismatch/token_fraction"] == 0.0 and metrics["mismatch/seq_fraction"] == 0.0


def test_proximal_equal_to_behaviour_is_standard_ppo():
    theta, prox, _, adv = tokens(32, 5)
    loss, _ = ppo_loss(
        theta,
        prox,
        prox,
        adv,
        torch.full((32,), 1 / 32, dtype=torch.float64),
        torch.zeros(32, dtype=torch.int64),
        AlgoConfig(**ALGO),
    )
    ratio = torch.exp(theta - prox)
    ppo = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv).mean()
    assert float(loss) == pytest.approx(float(ppo), rel=1e-12)


@pytest.mark.parametrize("case", ["default", "seq_mask", "seq_mean_token_mean"])
def test_microbatches_sum_to_the_full_batch_loss(case):
    algo = AlgoConfig(**ALGO, **CASES[case])
    lengths = [4, 7, 2, 9, 5]
    theta, prox, behav, adv = tokens(sum(lengths), 7)
    seqs, masks = layout(lengths, masked=(1, 12))
    weight = torch.as_tensor(np.concatenate(token_weights(masks, algo.loss_agg)))
    full, full_stats = ppo_loss(theta, prox, behav, adv, weight, seqs, algo)
    parts, stats = 0.0, LossStats()
    for first, last in ((0, 2), (2, 3), (3, 5)):  # whole samples per micro-batch
        sl = slice(sum(lengths[:first]), sum(lengths[:last]))
        part, s = ppo_loss(theta[sl], prox[sl], behav[sl], adv[sl], weight[sl], seqs[sl] - first, algo)
        parts += float(part)
        stats.add(s)
    assert parts == pytest.approx(float(full), rel=1e-12)
    assert stats.to_metrics() == pytest.approx(full_stats.to_metrics())


def test_bad_shapes_raise():
    theta, prox, behav, adv = tokens(8, 9)
    with pytest.raises(ValueError, match="shape"):
        ppo_loss(
            theta, prox[:4], behav, adv, torch.ones(8), torch.zeros(8, dtype=torch.int64), AlgoConfig(**ALGO)
        )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (dict(eps_clip_high=0.1), "algo.eps_clip_high"),
        (dict(dual_clip_c=0.5), "algo.dual_clip_c"),
        (dict(behav_weight_mode=BehavWeightMode.truncate), "algo.behav_weight_cap"),
        (dict(behav_weight_mode=BehavWeightMode.seq_mask, mis_low=1.2), "algo.mis_low"),
        (dict(kl_coef=-1.0), "algo.kl_coef"),
        (dict(adv_eps=0.0), "algo.adv_eps"),
        (dict(overlong_buffer=-1), "algo.overlong_buffer"),
        (dict(max_discarded_groups=0), "algo.max_discarded_groups"),
    ],
)
def test_invalid_settings_name_the_override(override, message):
    with pytest.raises(ValueError, match=message):
        AlgoConfig(**ALGO, **override)


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_a_ratio_past_float32s_exp_range_gives_a_finite_gradient(adv):
    """θ - p = 90 in float32: exp overflows to inf. With A = +1 the clipped branch wins the max and
    the loss was finite, but torch.maximum's backward multiplied the losing branch's inf by 0: a NaN
    gradient. The log-ratio is clamped at ±20 (verl's bound), past which the clip has taken over."""
    theta = torch.tensor([90.0, -1.0], requires_grad=True)
    prox = torch.tensor([0.0, -1.1])
    algo = AlgoConfig(batch_size=1, group_size=2)
    weight = torch.full((2,), 0.5)
    loss, stats = ppo_loss(theta, prox, prox, torch.full((2,), adv), weight, torch.arange(2), algo)
    (grad,) = torch.autograd.grad(loss, theta)
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), (loss, grad)
    assert float(grad[0]) == 0.0  # past the bound: no gradient either way (A < 0: clamp's zero slope)
    # the in-range token keeps its exact PPO gradient: -A r a, r = e^0.1 (inside 1 ± 0.2)
    assert float(grad[1]) == pytest.approx(-adv * math.exp(0.1) * 0.5, rel=1e-6)
    assert math.isfinite(stats.ratio_sum)
