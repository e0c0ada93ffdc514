"""The decoupled PPO loss against a direct per-token formula, including p = b (standard PPO)."""

import math

import pytest
import torch

from areal_jobs.trainer.loss import LossStats, decoupled_ppo_loss


def reference_loss(theta, prox, behav, adv, eps, n_total, cap=0.0):
    """Token by token, straight from the paper's objective."""
    total = 0.0
    for t, p, b, a in zip(theta, prox, behav, adv):
        r = math.exp(t - p)
        w = math.exp(p - b)
        if cap > 0 and w > cap:
            continue
        total += -w * min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
    return total / n_total


def random_tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    theta = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    prox = theta + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    behav = prox + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return theta, prox, behav, adv


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cap", [0.0, 1.2])
def test_matches_per_token_formula(seed, cap):
    theta, prox, behav, adv = random_tokens(64, seed)
    loss, stats = decoupled_ppo_loss(
        theta.clone().requires_grad_(),
        prox,
        behav,
        adv,
        torch.ones(64),
        clip_eps=0.2,
        num_global_tokens=64,
        behav_weight_cap=cap,
    )
    expected = reference_loss(theta.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), 0.2, 64, cap)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert stats.num_tokens + stats.capped_tokens == 64
    if cap == 0:
        assert stats.capped_tokens == 0


def test_proximal_equal_to_behaviour_is_standard_ppo():
    theta, prox, _, adv = random_tokens(32, 5)
    decoupled, _ = decoupled_ppo_loss(
        theta, prox, prox, adv, torch.ones(32), clip_eps=0.2, num_global_tokens=32
    )
    ratio = torch.exp(theta - prox)
    ppo = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv).mean()
    assert float(decoupled) == pytest.approx(float(ppo), rel=1e-12)


def test_gradient_only_flows_through_current_logprobs():
    theta, prox, behav, adv = random_tokens(16, 3)
    theta.requires_grad_()
    prox.requires_grad_()
    loss, _ = decoupled_ppo_loss(theta, prox, behav, adv, torch.ones(16), clip_eps=0.2, num_global_tokens=16)
    loss.backward()
    assert theta.grad is not None and prox.grad is None
    # unclipped tokens have d loss / d theta = -w * r * A / N
    r, w = torch.exp(theta - prox), torch.exp(prox - behav)
    inside = (r > 0.8) & (r < 1.2)
    expected = (-w * r * adv / 16)[inside]
    torch.testing.assert_close(theta.grad[inside], expected.detach())


def test_microbatches_sum_to_the_full_batch_loss():
    theta, prox, behav, adv = random_tokens(90, 7)
    full, full_stats = decoupled_ppo_loss(
        theta, prox, behav, adv, torch.ones(90), clip_eps=0.2, num_global_tokens=90
    )
    parts, stats = 0.0, LossStats()
    for sl in (slice(0, 10), slice(10, 55), slice(55, 90)):
        part, s = decoupled_ppo_loss(
            theta[sl],
            prox[sl],
            behav[sl],
            adv[sl],
            torch.ones(sl.stop - sl.start),
            clip_eps=0.2,
            num_global_tokens=90,
        )
        parts += float(part)
        stats.add(s)
    assert parts == pytest.approx(float(full), rel=1e-12)
    assert stats.to_metrics() == pytest.approx(full_stats.to_metrics())


def test_mask_excludes_tokens_and_bad_shapes_raise():
    theta, prox, behav, adv = random_tokens(8, 9)
    mask = torch.tensor([1, 1, 0, 0, 1, 1, 1, 1.0], dtype=torch.float64)
    loss, stats = decoupled_ppo_loss(theta, prox, behav, adv, mask, clip_eps=0.2, num_global_tokens=6)
    keep = mask.bool()
    expected = reference_loss(
        theta[keep].tolist(), prox[keep].tolist(), behav[keep].tolist(), adv[keep].tolist(), 0.2, 6
    )
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert stats.num_tokens == 6
    with pytest.raises(ValueError, match="shape"):
        decoupled_ppo_loss(theta, prox[:4], behav, adv, mask, clip_eps=0.2, num_global_tokens=6)
    with pytest.raises(ValueError, match="num_global_tokens"):
        decoupled_ppo_loss(theta, prox, behav, adv, mask, clip_eps=0.2, num_global_tokens=0)
