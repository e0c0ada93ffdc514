"""The objective's peer conventions (issue 26) with hand-made values: the clamped behaviour weight,
the k3 clamp, the overlong slope past the limit, group_size=1, GSPO's sequence ratio, the entropy
bonus and AReaL's reward scaling. docs/objective.md says whose convention each one follows."""

import math

import numpy as np
import pytest
import torch

from areal_jobs.config.algo import (
    Advantage,
    AlgoConfig,
    ImportanceLevel,
    KLEstimator,
    LossAgg,
)
from areal_jobs.trainer.intake.batch import assemble
from areal_jobs.trainer.objective.advantages import overlong_penalty, shape_rewards
from areal_jobs.trainer.objective.loss import ppo_loss, token_weights
from areal_jobs.transport import messages as m

ALGO = dict(batch_size=4, group_size=4)
F64 = torch.float64


def t(values):
    return torch.tensor(values, dtype=F64)


# ------------------------------------------------------------------ behaviour weight overflow


@pytest.mark.parametrize("behav", [-100.0, float("-inf")])
def test_an_overflowing_behaviour_weight_is_dropped_not_nan(behav):
    """p - b = 100 (or inf): exp overflows float32 and float64 alike at inf; drop mode used to
    multiply it by 0 (NaN). Clamped at 20 (verl's SAFETY_BOUND) it is e^20 > cap: dropped."""
    theta = torch.zeros(2, dtype=torch.float32, requires_grad=True)
    prox = torch.zeros(2, dtype=torch.float32)
    behav_logp = torch.tensor([behav, 0.0], dtype=torch.float32)
    algo = AlgoConfig(**ALGO, behav_weight_cap=5.0)
    loss, stats = ppo_loss(
        theta, prox, behav_logp, torch.ones(2), torch.full((2,), 0.5), torch.tensor([0, 0]), algo
    )
    loss.backward()
    # the dropped token adds nothing; the other: -A * r * w * a = -1 * 1 * 1 * 0.5
    assert float(loss) == pytest.approx(-0.5)
    assert theta.grad.tolist() == pytest.approx([0.0, -0.5])
    assert stats.affected_tokens == 1.0
    assert math.isfinite(stats.behav_weight_sum) and math.isfinite(stats.k3_sum)
    assert stats.abs_diff_sum == pytest.approx(20.0)  # |p - b| reported at the bound


def test_the_uncapped_behaviour_weight_stops_at_e20():
    theta = torch.zeros(1, dtype=F64, requires_grad=True)
    loss, _ = ppo_loss(
        theta, t([0.0]), t([-100.0]), t([1.0]), t([1.0]), torch.tensor([0]), AlgoConfig(**ALGO)
    )
    assert float(loss) == pytest.approx(-math.exp(20.0))


# ------------------------------------------------------------------ group of one


@pytest.mark.parametrize("advantage", list(Advantage))
def test_a_group_of_one_is_refused_for_every_advantage(advantage):
    """drgrpo used to accept it and give every sample advantage 0 (a run that trains nothing)."""
    with pytest.raises(ValueError, match=r"algo\.group_size=1.*set algo\.group_size>=2"):
        AlgoConfig(group_size=1, advantage=advantage)


# ------------------------------------------------------------------ k3 clamp


@pytest.mark.parametrize(
    ("x", "value", "slope"),
    [
        (2.0, math.exp(-2.0) + 1.0, 1 - math.exp(-2.0)),  # inside the bounds: the plain estimator
        (-2.0, math.exp(2.0) - 3.0, 1 - math.exp(2.0)),
        (-3.0, 10.0, 0.0),  # e^3 - 4 = 16.1 > 10: held at 10 (verl low_var_kl, AReaL), no gradient
        (15.0, 10.0, 0.0),  # 14.0000003 > 10
        (-300.0, 10.0, 0.0),  # e^300 would be inf; x is clamped to -20 first
    ],
)
def test_k3_is_clamped_as_verls_low_var_kl(x, value, slope):
    theta = torch.tensor([x], dtype=F64, requires_grad=True)
    zero = torch.zeros(1, dtype=F64)
    algo = AlgoConfig(**ALGO, kl_coef=1.0, kl_estimator=KLEstimator.k3)
    loss, stats = ppo_loss(
        theta, theta.detach(), theta.detach(), zero, t([1.0]), torch.tensor([0]), algo, ref_logp=zero
    )
    loss.backward()
    assert float(loss) == pytest.approx(value, rel=1e-12)
    assert float(theta.grad) == pytest.approx(slope, rel=1e-12, abs=1e-15)
    assert stats.kl_ref_sum == pytest.approx(value)


def test_k1_and_k2_are_not_clamped():
    zero = torch.zeros(1, dtype=F64)
    for estimator, expected in ((KLEstimator.k1, -30.0), (KLEstimator.k2, 450.0)):
        algo = AlgoConfig(**ALGO, kl_coef=1.0, kl_estimator=estimator)
        loss, _ = ppo_loss(
            t([-30.0]), t([-30.0]), t([-30.0]), zero, t([1.0]), torch.tensor([0]), algo, ref_logp=zero
        )
        assert float(loss) == pytest.approx(expected)


# ------------------------------------------------------------------ overlong penalty


def test_overlong_penalty_keeps_its_slope_past_the_limit():
    """verl's DAPO reward manager and AReaL's reward_overlong_penalty: -excess / buffer * factor,
    no floor. A multi-turn episode can be longer than one turn's max_new_tokens."""
    assert overlong_penalty(100, 100, 20, 1.0) == pytest.approx(1.0)
    assert overlong_penalty(120, 100, 20, 1.0) == pytest.approx(2.0)
    assert overlong_penalty(150, 100, 20, 0.5) == pytest.approx(1.75)


# ------------------------------------------------------------------ GSPO


def test_sequence_ratio_by_hand():
    """One sample, θ - p = ln 1.1 and ln 1.3, A = 1, token mean: the sequence ratio is
    sqrt(1.1 * 1.3) = 1.19583 (inside the clip), the loss -1.19583 and each token's gradient
    -1.19583 / 2 through the mean. Per token, 1.3 would be clipped at 1.2 with no gradient."""
    theta_values = [math.log(1.1), math.log(1.3)]
    weight = t([0.5, 0.5])
    s = math.sqrt(1.1 * 1.3)
    for level, loss_expected, grad_expected in (
        (ImportanceLevel.sequence, -s, [-s / 2, -s / 2]),
        (ImportanceLevel.token, -(1.1 + 1.2) / 2, [-1.1 / 2, 0.0]),
    ):
        theta = t(theta_values).requires_grad_()
        algo = AlgoConfig(**ALGO, importance_level=level)
        loss, stats = ppo_loss(
            theta, t([0.0, 0.0]), t([0.0, 0.0]), t([1.0, 1.0]), weight, torch.tensor([0, 0]), algo
        )
        loss.backward()
        assert float(loss) == pytest.approx(loss_expected, rel=1e-12)
        assert theta.grad.tolist() == pytest.approx(grad_expected, rel=1e-12)
    # a sequence ratio beyond the clip: every token of the sample is clipped (no gradient)
    theta = t([math.log(1.3), math.log(1.3)]).requires_grad_()
    algo = AlgoConfig(**ALGO, importance_level=ImportanceLevel.sequence)
    loss, stats = ppo_loss(
        theta, t([0.0, 0.0]), t([0.0, 0.0]), t([1.0, 1.0]), weight, torch.tensor([0, 0]), algo
    )
    loss.backward()
    assert float(loss) == pytest.approx(-1.2) and theta.grad.abs().sum() == 0
    assert stats.clipped_tokens == 2.0


def test_sequence_ratio_ignores_masked_tokens_and_other_samples():
    # sample 0: θ - p = ln 1.1 and (masked) ln 9; sample 1: ln 0.9 alone
    theta = t([math.log(1.1), math.log(9.0), math.log(0.9)]).requires_grad_()
    algo = AlgoConfig(**ALGO, importance_level=ImportanceLevel.sequence)
    loss, stats = ppo_loss(
        theta, torch.zeros(3, dtype=F64), torch.zeros(3, dtype=F64), t([1.0, 1.0, 1.0]),
        t([0.5, 0.0, 0.5]), torch.tensor([0, 0, 1]), algo,
    )  # fmt: skip
    loss.backward()
    assert float(loss) == pytest.approx(-(1.1 + 0.9) / 2)
    assert theta.grad.tolist() == pytest.approx([-1.1 / 2, 0.0, -0.9 / 2])
    assert stats.ratio_sum == pytest.approx(2.0)


def verl_gspo(theta, prox, adv, masks):
    """verl's compute_policy_loss_gspo restated from its definition: per-token ratio
    sg[s_i] * π_t / sg[π_t] (log clamped at 10), PPO clip, aggregated seq-mean-token-mean."""
    losses = []
    for th, p, a, mk in zip(theta, prox, adv, masks, strict=True):
        log_s = ((th - p) * mk).sum() / mk.sum()
        log_st = (th - th.detach() + log_s.detach()).clamp(max=10.0)
        st = torch.exp(log_st)
        pg = torch.maximum(-a * st, -a * st.clamp(0.8, 1.2))
        losses.append((pg * mk).sum() / mk.sum())
    return torch.stack(losses).mean()


def test_sequence_ratio_equals_verls_gspo_with_seq_mean_token_mean():
    """docs/objective.md: AReaL's definition, the gradient through the mean; with
    loss_agg=seq_mean_token_mean it equals verl's loss and gradient (where log s < 10)."""
    g = torch.Generator().manual_seed(3)
    lengths = [4, 7, 3]
    theta = [-torch.rand(n, generator=g, dtype=F64) for n in lengths]
    prox = [th + 0.15 * torch.randn(n, generator=g, dtype=F64) for th, n in zip(theta, lengths)]
    adv = [torch.full((n,), a, dtype=F64) for n, a in zip(lengths, (1.0, -0.7, 0.4))]
    masks = [torch.ones(n, dtype=F64) for n in lengths]
    masks[1][2] = 0
    algo = AlgoConfig(**ALGO, importance_level=ImportanceLevel.sequence, loss_agg=LossAgg.seq_mean_token_mean)
    weight = torch.as_tensor(np.concatenate(token_weights([mk.numpy() for mk in masks], algo.loss_agg)))
    ours_theta = torch.cat(theta).requires_grad_()
    seq_index = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    ours, _ = ppo_loss(ours_theta, torch.cat(prox), torch.cat(prox), torch.cat(adv), weight, seq_index, algo)
    ours.backward()
    theirs_theta = [th.clone().requires_grad_() for th in theta]
    theirs = verl_gspo(theirs_theta, prox, adv, masks)
    theirs.backward()
    assert float(ours) == pytest.approx(float(theirs), rel=1e-12)
    np.testing.assert_allclose(
        ours_theta.grad.numpy(), torch.cat([th.grad for th in theirs_theta]).numpy(), rtol=1e-10, atol=1e-15
    )


# ------------------------------------------------------------------ entropy bonus


def test_entropy_bonus_is_a_loss_term_with_gradient():
    """loss_t = w pg - coef * H_t: with A = 0 the loss is -coef * Σ a_t H_t, and each entropy gets
    gradient -coef * a_t (verl's entropy_coeff, aggregated like the loss)."""
    entropy = t([1.0, 3.0]).requires_grad_()
    zero = torch.zeros(2, dtype=F64)
    algo = AlgoConfig(**ALGO, entropy_coef=0.01)
    loss, stats = ppo_loss(
        zero, zero, zero, zero, t([0.25, 0.75]), torch.tensor([0, 0]), algo, entropy=entropy
    )
    loss.backward()
    assert float(loss) == pytest.approx(-0.01 * (0.25 + 2.25))
    assert entropy.grad.tolist() == pytest.approx([-0.0025, -0.0075])
    assert stats.entropy_sum == pytest.approx(4.0)
    with pytest.raises(ValueError, match="entropy"):
        ppo_loss(zero, zero, zero, zero, t([0.25, 0.75]), torch.tensor([0, 0]), algo)


# ------------------------------------------------------------------ reward scaling


def test_reward_scaling_bias_and_clip_by_hand():
    # (r - 0.5) * 10 clipped to ±3: AReaL's order
    assert shape_rewards(np.array([0.0, 1.0, 0.3, 0.6]), 10.0, -0.5, 3.0).tolist() == pytest.approx(
        [-3.0, 3.0, -2.0, 1.0]
    )
    assert shape_rewards(np.array([0.0, 1.0]), 2.0, 1.0, 0.0).tolist() == [2.0, 4.0]  # clip 0 = off


def group(rewards, lengths):
    samples = tuple(
        m.SampleTrajectory(
            sample_id=f"g/{i}",
            output_ids=np.ones(n, np.int32),
            logprobs=np.zeros(n, np.float32),
            versions=np.zeros(n, np.int32),
            reward=r,
            reward_status="ok",
            finish_reason="stop",
            num_interruptions=0,
        )
        for i, (r, n) in enumerate(zip(rewards, lengths, strict=True))
    )
    return m.TrajectoryGroup("g", 0, np.ones(2, np.int32), samples)


def test_reward_shaping_runs_after_the_overlong_penalty_and_before_advantages():
    """max_new_tokens 4, buffer 2: the 3-token answer loses 0.5 first; then (r - 0.5) * 10 clipped
    at 3: 1.0 -> 3 (clipped from 5), 0.5 -> 0, 0.0 -> -3 (clipped from -5); Dr.GRPO: r - mean."""
    algo = AlgoConfig(
        batch_size=1, group_size=3, advantage=Advantage.drgrpo, overlong_buffer=2,
        reward_scaling=10.0, reward_bias=-0.5, reward_clip=3.0,
    )  # fmt: skip
    batch = assemble([group([1.0, 1.0, 0.0], [1, 3, 1])], 0, algo, max_new_tokens=4)
    assert [s.reward for s in batch.samples] == pytest.approx([3.0, 0.0, -3.0])
    assert [s.advantage for s in batch.samples] == pytest.approx([3.0, 0.0, -3.0])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (dict(entropy_coef=-0.1), "algo.entropy_coef"),
        (dict(reward_scaling=0.0), "algo.reward_scaling"),
        (dict(reward_clip=-1.0), "algo.reward_clip"),
    ],
)
def test_invalid_new_settings_name_the_override(override, message):
    with pytest.raises(ValueError, match=message):
        AlgoConfig(**ALGO, **override)
