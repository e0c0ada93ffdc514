"""Issue 42's objectives (trainer/objective/objectives.py through ppo_loss) against numbers worked by hand
from each source's definition: small float64 tensors, the arithmetic written out with `math`,
loss AND gradient (a masked token has none; CISPO's weight carries none)."""

import math
from dataclasses import replace

import pytest
import torch

from areal_jobs.config.algo import AlgoConfig, EssStep, Objective
from areal_jobs.trainer.objective.loss import ppo_loss
from areal_jobs.trainer.objective.objectives import (
    ess_lr_scale,
    m2po_areal_masked,
    m2po_clip,
    m2po_tau,
    set_lr_scale,
)

F64 = torch.float64
ALGO = dict(batch_size=4, group_size=4)
L = math.log


def t(values):
    return torch.tensor(values, dtype=F64)


def run(theta, prox, behav, adv, seqs, algo, weight=None):
    """ppo_loss with token-mean weights 1/T; returns (loss, d loss / d theta, stats)."""
    theta = t(theta).requires_grad_(True)
    n = theta.numel()
    weight = t([1.0 / n] * n) if weight is None else t(weight)
    loss, stats = ppo_loss(theta, t(prox), t(behav), t(adv), weight, torch.tensor(seqs), algo)
    loss.backward()
    return float(loss.detach()), theta.grad.tolist(), stats


# ------------------------------------------------------------------ config


def test_objective_auto_follows_the_old_keys_and_anchors_set_decoupled():
    """The default since issue 42 is naive PPO; algo.decoupled=true keeps AReaL's objective; an
    explicit algo.objective decides algo.decoupled (so dataclasses.replace of a resolved config
    with another objective works both ways)."""
    assert AlgoConfig().decoupled is False and AlgoConfig().loss_objective is Objective.ppo
    assert AlgoConfig(**ALGO, decoupled=True).loss_objective is Objective.decoupled
    assert AlgoConfig(**ALGO, decoupled=False).loss_objective is Objective.ppo
    for name in ("m2po", "prime", "cispo", "ppo"):
        for decoupled in (False, True):
            algo = AlgoConfig(**ALGO, objective=name, decoupled=decoupled)
            assert (
                algo.loss_objective is Objective(name) and algo.decoupled is False
            )  # p = b: no proximal pass
    for name in ("icepop", "m2po_areal", "decoupled"):
        assert AlgoConfig(**ALGO, objective=name).decoupled is True
        assert replace(AlgoConfig(**ALGO), objective=name).decoupled is True


@pytest.mark.parametrize(
    "bad, key",
    [
        (dict(icepop_low=1.0), "algo.icepop_low"),
        (dict(m2_budget=0.0), "algo.m2_budget"),
        (dict(prime_mask_high=0.0), "algo.prime_mask_low/high"),
        (dict(cispo_eps_high=0.0), "algo.cispo_eps_low"),
        (dict(objective="cispo", dual_clip_c=3.0), "algo.dual_clip_c=0"),
        (dict(objective="m2po", prox_logp="loglinear"), "algo.prox_logp=loglinear"),
    ],
)
def test_bad_objective_knobs_are_refused_by_name(bad, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.").replace("/", "/")):
        AlgoConfig(**ALGO, **bad)


def test_decoupled_false_and_objective_ppo_are_one_loss():
    args = ([0.1, -0.2, 0.3], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, -1.0], [0, 0, 1])
    assert (
        run(*args, AlgoConfig(**ALGO, decoupled=False))[:2]
        == run(*args, AlgoConfig(**ALGO, objective="ppo"))[:2]
    )


# ------------------------------------------------------------------ icepop


def test_icepop_token_band_masks_tokens_outside_it():
    """θ = p (r = 1), w = 0.4, 2, 6, band [0.5, 5], A = 1, a_t = 1/3: only the middle token
    counts: loss = -w·r·A·a = -2/3, its gradient -w·r·A·a = -2/3, the others 0."""
    algo = AlgoConfig(**ALGO, objective="icepop")
    prox = [0.0, 0.0, 0.0]
    behav = [-L(0.4), -L(2.0), -L(6.0)]  # p - b = log w
    loss, grad, stats = run(prox, prox, behav, [1.0, 1.0, 1.0], [0, 0, 0], algo)
    assert loss == pytest.approx(-2.0 / 3.0, rel=1e-12)
    assert grad == pytest.approx([0.0, -2.0 / 3.0, 0.0], rel=1e-12, abs=0.0)
    assert stats.affected_tokens == 2.0 and stats.affected_seqs == 1.0


def test_icepop_sequence_level_tests_the_geometric_mean():
    """Sample 0: w = 0.4, 0.4 (geometric mean 0.4 < 0.5: masked); sample 1: w = 2, 8 (mean
    sqrt(16) = 4, in [0.5, 5]: kept although 8 > 5). a_t = 1/4, A = 1: loss = -(2 + 8)/4."""
    algo = AlgoConfig(**ALGO, objective="icepop", icepop_level="sequence")
    prox = [0.0] * 4
    behav = [-L(0.4), -L(0.4), -L(2.0), -L(8.0)]
    loss, grad, stats = run(prox, prox, behav, [1.0] * 4, [0, 0, 1, 1], algo)
    assert loss == pytest.approx(-10.0 / 4.0, rel=1e-12)
    assert grad == pytest.approx([0.0, 0.0, -2.0 / 4.0, -8.0 / 4.0], rel=1e-12, abs=0.0)
    assert stats.affected_tokens == 2.0 and stats.affected_seqs == 1.0


# ------------------------------------------------------------------ m2po (official)


def test_m2po_tau_takes_the_official_breakpoint():
    """(log r)² = 0.01, 0.04, 0.09, 0.25: mean 0.0975 > 0.04, target 4 x 0.04 = 0.16. Capped at
    each value in turn: 0.01·3 + 0.01 = 0.04, 0.04·2 + 0.05 = 0.13, 0.09·1 + 0.14 = 0.23 >= 0.16:
    k = 2, τ = sqrt(0.04) = 0.2 (the breakpoint below, not the exact root sqrt(0.055))."""
    assert m2po_tau(t([0.09, 0.01, 0.25, 0.04]), 0.04) == pytest.approx(0.2, abs=1e-10)
    assert m2po_tau(t([0.09, 0.01, 0.25, 0.04]), 0.1) is None  # mean 0.0975 within the budget
    assert m2po_tau(t([]), 0.04) is None
    assert m2po_tau(t([0.5, 0.6]), 0.04) == 0.0  # k = 0: 0.5·1 + 0.5 >= 0.08


def tokens_m2po():
    """Sample 0 (A = +1): log r = 0.1, 0.3, -0.25; sample 1 (A = -1): -0.2, 0.5, -0.5. Harmful
    (A > 0, r > 1 or A < 0, r < 1): 0.1, 0.3, -0.2, -0.5 -> (log r)² 0.01, 0.09, 0.04, 0.25."""
    behav = [0.0] * 6
    theta = [0.1, 0.3, -0.25, -0.2, 0.5, -0.5]
    return theta, behav, [1.0, 1.0, 1.0, -1.0, -1.0, -1.0], [0, 0, 0, 1, 1, 1]


def test_m2po_loss_clips_around_the_behaviour_policy_at_tau():
    """τ = 0.2: r kept in [e^-0.2, e^0.2]; a_t = 1/6. Per token max(-A r, -A clip(r)):
    0.1: -e^0.1 (inside), grad -e^0.1 | 0.3: -e^0.2 (clipped), 0 | -0.25: -e^-0.25 (A > 0, r
    below the range: not clipped), grad -e^-0.25 | -0.2: the token at τ itself, clipped (τ² =
    0.04 - 1e-12): e^-0.2, 0 | 0.5: e^0.5 (A < 0, r > 1: never clipped), grad e^0.5 | -0.5: e^-0.2, 0."""
    theta, behav, adv, seqs = tokens_m2po()
    algo = AlgoConfig(**ALGO, objective="m2po")  # m2_budget 0.04
    prox_ignored = [9.0] * 6  # anchored on π_b: p is not read
    loss, grad, stats = run(theta, prox_ignored, behav, adv, seqs, algo)
    e = math.exp
    expected = (-e(0.1) - e(0.2) - e(-0.25) + e(-0.2) + e(0.5) + e(-0.2)) / 6
    assert loss == pytest.approx(expected, rel=1e-9)
    assert grad == pytest.approx([-e(0.1) / 6, 0.0, -e(-0.25) / 6, 0.0, e(0.5) / 6, 0.0], rel=1e-9, abs=0.0)
    assert stats.clipped_tokens == 3.0
    assert stats.m2po_bound_microbatches == 1.0 and stats.m2po_tau_sum == pytest.approx(0.2, abs=1e-10)
    assert stats.abs_diff_sum == 0.0  # w = 1: p is b


def test_m2po_within_budget_does_not_clip():
    theta, behav, adv, seqs = tokens_m2po()
    loss, grad, stats = run(
        theta, behav, behav, adv, seqs, AlgoConfig(**ALGO, objective="m2po", m2_budget=0.1)
    )
    r = [math.exp(x) for x in theta]
    assert loss == pytest.approx(sum(-a * x for a, x in zip(adv, r, strict=True)) / 6, rel=1e-12)
    assert grad == pytest.approx([-a * x / 6 for a, x in zip(adv, r, strict=True)], rel=1e-12)
    assert stats.clipped_tokens == 0.0 and stats.m2po_bound_microbatches == 0.0


def test_m2po_optional_bounds_on_its_range():
    """ε_low = 1 - e^-0.2 = 0.181 floored at 0.3 -> 0.7; ε_high = e^0.2 - 1 = 0.221 capped at 0.1 -> 1.1."""
    theta, _, adv, _ = tokens_m2po()
    algo = AlgoConfig(**ALGO, objective="m2po", m2po_min_eps_low=0.3, m2po_max_eps_high=0.1)
    low, high, tau = m2po_clip(t(theta), t(adv), t([1.0] * 6), algo)
    assert (low, high) == pytest.approx((0.7, 1.1)) and tau == pytest.approx(0.2, abs=1e-10)


# ------------------------------------------------------------------ m2po, AReaL's port


def test_m2po_areal_masks_the_largest_until_the_rest_is_within_budget():
    """(b - p)² = 0.25, 0.09, 0.01, 0 (sorted descending); suffix means 0.35/4 = 0.0875,
    0.10/3 = 0.033 < 0.04: j = 1, the 0.25 token is masked; the rest is decoupled PPO with
    θ = p, A = 1, a = 1/4: loss = -(w_1 + w_2 + w_3)/4, w = e^(p - b)."""
    prox = [0.0] * 4
    behav = [-0.5, 0.3, -0.1, 0.0]  # p - b = 0.5, -0.3, 0.1, 0
    algo = AlgoConfig(**ALGO, objective="m2po_areal")
    loss, grad, stats = run(prox, prox, behav, [1.0] * 4, [0, 0, 1, 1], algo)
    w = [math.exp(0.5), math.exp(-0.3), math.exp(0.1), 1.0]
    assert loss == pytest.approx(-(w[1] + w[2] + w[3]) / 4, rel=1e-12)
    assert grad == pytest.approx([0.0, -w[1] / 4, -w[2] / 4, -w[3] / 4], rel=1e-12, abs=0.0)
    assert stats.affected_tokens == 1.0
    # none below the budget: all but one token masked (AReaL keeps n - 1 masked, never all)
    assert m2po_areal_masked(t([1.0, -1.0, 2.0]), t([1.0, 1.0, 1.0]), 0.04).tolist() == [1.0, 0.0, 1.0]


# ------------------------------------------------------------------ prime-rl


def test_prime_masks_by_the_probability_change_and_adds_the_kl_to_the_sampler():
    """b = log 0.5 everywhere. Token 0: π 0.8 (Δp +0.3 > 0.2, A > 0: masked); 1: π 0.6 (+0.1, kept);
    2: π 0.2 (-0.3 < -0.2, A < 0: masked); 3: π 0.45 (-0.05, kept). Per token
    -keep·A·r + 1e-3·(log r)², gradient -keep·A·r + 2e-3·log r; a = 1/4."""
    algo = AlgoConfig(**ALGO, objective="prime")
    probs, adv = [0.8, 0.6, 0.2, 0.45], [1.0, 1.0, -1.0, -1.0]
    theta, behav = [L(p) for p in probs], [L(0.5)] * 4
    loss, grad, stats = run(theta, behav, behav, adv, [0, 0, 1, 1], algo)
    r = [p / 0.5 for p in probs]
    keep = [0.0, 1.0, 0.0, 1.0]
    per = [-k * a * x + 1e-3 * L(x) ** 2 for k, a, x in zip(keep, adv, r, strict=True)]
    grads = [(-k * a * x + 2e-3 * L(x)) / 4 for k, a, x in zip(keep, adv, r, strict=True)]
    assert loss == pytest.approx(sum(per) / 4, rel=1e-12)
    assert grad == pytest.approx(grads, rel=1e-12)
    # a masked token keeps only the KL's gradient: 2e-3·log(1.6)/4
    assert grad[0] == pytest.approx(2e-3 * L(1.6) / 4, rel=1e-12)
    assert stats.clipped_tokens == 2.0


# ------------------------------------------------------------------ cispo


def test_cispo_truncated_detached_weight_on_every_token():
    """r = π_θ/π_b = 1.5, 1.1, 0.5; ε_high 0.2, no lower bound: weights 1.2, 1.1, 0.5. Loss
    -Σ sg(weight)·A·log π_θ / 3; gradient -weight·A/3 on every token (a weight with gradient
    would add -A·log π_θ·d weight/dθ: -1.1·log 0.55/3 on token 1)."""
    algo = AlgoConfig(**ALGO, objective="cispo")
    probs, behav_p, adv = [0.3, 0.55, 0.2], [0.2, 0.5, 0.4], [1.0, 1.0, -1.0]
    theta = [L(p) for p in probs]
    loss, grad, stats = run(theta, [L(p) for p in behav_p], [L(p) for p in behav_p], adv, [0, 0, 1], algo)
    weights = [1.2, 1.1, 0.5]
    assert loss == pytest.approx(
        sum(-w * a * x for w, a, x in zip(weights, adv, theta, strict=True)) / 3, rel=1e-12
    )
    assert grad == pytest.approx([-w * a / 3 for w, a in zip(weights, adv, strict=True)], rel=1e-12)
    assert stats.clipped_tokens == 1.0
    # a lower bound: cispo_eps_low 0.4 holds the weight at >= 0.6
    loss_low, grad_low, _ = run(
        theta, [L(p) for p in behav_p], [L(p) for p in behav_p], adv, [0, 0, 1],
        AlgoConfig(**ALGO, objective="cispo", cispo_eps_low=0.4),
    )  # fmt: skip
    assert grad_low[2] == pytest.approx(0.6 / 3, rel=1e-12)


# ------------------------------------------------------------------ ESS-scaled step


def test_ess_lr_scale_by_hand():
    """w = 1, 1, 4: ESS = 6² / (3·18) = 2/3; sqrt -> 0.8165, linear -> 2/3, off -> 1."""
    for step, expected in (("sqrt", math.sqrt(2 / 3)), ("linear", 2 / 3), ("off", 1.0)):
        assert ess_lr_scale(AlgoConfig(**ALGO, ess_step=step), 6.0, 18.0, 3.0) == pytest.approx(expected)
    # the loss reports the sums of w = π_θ/π_b at the gradient pass, whatever the objective
    _, _, stats = run([L(4.0), 0.0, 0.0], [0.0] * 3, [0.0] * 3, [1.0] * 3, [0, 0, 0], AlgoConfig(**ALGO))
    assert (stats.cur_w_sum, stats.cur_w_sq_sum, stats.num_tokens) == pytest.approx((6.0, 18.0, 3.0))
    assert stats.to_metrics()["ppo/step_ess"] == pytest.approx(2 / 3)


def test_set_lr_scale_scales_the_step_from_the_base_lr():
    p = torch.nn.Parameter(torch.zeros(1, dtype=F64))
    opt = torch.optim.SGD([p], lr=0.1)
    for scale in (0.5, 0.25):  # from the base lr each time, not compounding
        p.grad = torch.ones(1, dtype=F64)
        before = float(p.detach())
        set_lr_scale(opt, scale)
        opt.step()
        assert before - float(p.detach()) == pytest.approx(0.1 * scale)
    assert AlgoConfig(**ALGO, ess_step="sqrt").ess_step is EssStep.sqrt
