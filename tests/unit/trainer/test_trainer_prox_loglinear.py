"""algo.prox_logp=loglinear: AReaL's proximal log-probs from per-token versions, by hand (float64),
through the loss and its gradient, and in the torch backend (no proximal forward pass); and
algo.prox_logp=current, the gradient pass's own log-probs (exact with one minibatch)."""

import math

import pytest
import torch
from test_trainer_torch_backend import make_backend, make_batch

from areal_jobs.config import AlgoConfig
from areal_jobs.config.algo import ProxLogp
from areal_jobs.trainer.objective.loss import loglinear_prox_logp, ppo_loss

F64 = torch.float64


def test_alpha_by_version_as_areal_defines_it():
    """Trainer at version 5 (v_θ = 5, v_prox = 4): α = (4 - v_b) / (5 - v_b), clamped to [0, 1];
    0 for a token of the current weights (v_b = 5: AReaL's guard on v_θ - v_b > 0) and for a
    token without a generation version (v_b < 0). With b = 0 and θ = 1, p = α."""
    versions = torch.tensor([5, 4, 3, 2, 1, 0, -1, 6])
    prox = loglinear_prox_logp(torch.zeros(8, dtype=F64), torch.ones(8, dtype=F64), versions, 5)
    expected = [0.0, 0.0, 1 / 2, 2 / 3, 3 / 4, 4 / 5, 0.0, 0.0]
    assert prox.tolist() == pytest.approx(expected, abs=1e-15)


def test_proximal_log_probs_carry_no_gradient():
    theta = torch.tensor([-1.0, -2.0], dtype=F64, requires_grad=True)
    prox = loglinear_prox_logp(torch.tensor([-3.0, -3.0], dtype=F64), theta, torch.tensor([1, 2]), 4)
    assert not prox.requires_grad
    assert prox.tolist() == pytest.approx([-3.0 + 2 / 3 * 2.0, -3.0 + 1 / 2 * 1.0])


def test_hand_worked_loss_and_gradient_with_a_masked_and_a_fresh_token():
    """Trainer version 5, token_mean over the 5 valid tokens (a = 1/5; token 5 masked), clip 0.2.
    tok v_b   b     θ     A    α    p     r = e^(θ-p)  w = e^(p-b)  w·pg            d/dθ
    1   5   -1.0  -0.9   1    0   -1.0   e^0.1        1            -e^0.1          -e^0.1
    2   4   -3.0  -2.5   1    0   -3.0   e^0.5 > 1.2  1            -1.2 (clipped)   0
    3   3   -2.0  -1.8  -1   1/2  -1.9   e^0.1        e^0.1        +e^0.2          +e^0.2
    4   1   -1.4  -1.0   2   3/4  -1.1   e^0.1        e^0.3        -2 e^0.4        -2 e^0.4
    5   2   -1.0  -0.5   1   2/3  (masked: adds nothing)                            0
    6  -1   -0.5  -0.6  0.5   0   -0.5   e^-0.1       1            -0.5 e^-0.1     -0.5 e^-0.1
    all of the last two columns / 5. Token 1 is fresh (sampled by the weights being trained)
    and token 2 is one version behind: α = 0 keeps p = b for both, so the clip acts on r = e^(θ-b)."""
    behav = torch.tensor([-1.0, -3.0, -2.0, -1.4, -1.0, -0.5], dtype=F64)
    theta = torch.tensor([-0.9, -2.5, -1.8, -1.0, -0.5, -0.6], dtype=F64, requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0, 2.0, 1.0, 0.5], dtype=F64)
    versions = torch.tensor([5, 4, 3, 1, 2, -1])
    weight = torch.tensor([1, 1, 1, 1, 0, 1], dtype=F64) / 5
    prox = loglinear_prox_logp(behav, theta, versions, 5)
    assert prox.tolist() == pytest.approx([-1.0, -3.0, -1.9, -1.1, -1.0 + 2 / 3 * 0.5, -0.5])
    algo = AlgoConfig(batch_size=2, group_size=3, decoupled=True, prox_logp=ProxLogp.loglinear)
    loss, stats = ppo_loss(theta, prox, behav, adv, weight, torch.arange(6), algo)
    e = math.exp
    assert float(loss.detach()) == pytest.approx(
        (-e(0.1) - 1.2 + e(0.2) - 2 * e(0.4) - 0.5 * e(-0.1)) / 5, rel=1e-12
    )
    loss.backward()
    expected = [-e(0.1) / 5, 0.0, e(0.2) / 5, -2 * e(0.4) / 5, 0.0, -0.5 * e(-0.1) / 5]
    assert theta.grad.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert stats.num_tokens == 5 and stats.clipped_tokens == 1


def test_loglinear_needs_the_decoupled_loss_current_is_the_default_for_any_minibatches():
    with pytest.raises(ValueError, match=r"algo.prox_logp=loglinear.*algo.decoupled=true"):
        AlgoConfig(decoupled=False, prox_logp=ProxLogp.loglinear)
    assert AlgoConfig().prox_logp is ProxLogp.current
    # without the decoupled loss p = b: current (the default) has nothing to compute, no refusal
    assert AlgoConfig(decoupled=False).prox_logp is ProxLogp.current
    assert AlgoConfig(ppo_minibatches=2).prox_logp is ProxLogp.current
    assert AlgoConfig(decoupled=True, prox_logp="loglinear").prox_logp is ProxLogp.loglinear  # a string


def _backend(path, **algo):
    """The torch backend tests' backend, counting its forward passes; the decoupled objective
    (the proximal policy is what these tests are about) unless `decoupled=False` is given."""
    backend = make_backend(path, **{"decoupled": True, **algo})
    calls = []
    backend.model.register_forward_hook(lambda *_: calls.append(1))
    return backend, calls


def test_torch_backend_skips_the_proximal_pass(tiny_model_dir):
    """Tokens 0 or 1 versions old: α = 0, p = b, so the step is exactly standard PPO
    (algo.decoupled=false), with one forward per micro-batch instead of two."""
    for behind in (0, 1):
        batch = make_batch(version=3, versions_behind=behind)
        loglinear, calls = _backend(tiny_model_dir, prox_logp=ProxLogp.loglinear)
        got = loglinear.train_step(batch)
        naive, naive_calls = _backend(tiny_model_dir, decoupled=False)
        want = naive.train_step(batch)
        assert len(calls) == len(naive_calls) == got["train/num_microbatches"]
        assert got["train/loss"] == want["train/loss"] and got["train/prox_behav_abs_diff"] == 0.0
        for a, b in zip(loglinear.model.parameters(), naive.model.parameters(), strict=True):
            assert torch.equal(a, b)
    recompute, calls = _backend(tiny_model_dir, prox_logp=ProxLogp.recompute)
    metrics = recompute.train_step(make_batch(version=3, versions_behind=1))
    assert len(calls) > metrics["train/num_microbatches"]  # the proximal pass ran first


def test_torch_backend_interpolates_older_tokens(tiny_model_dir):
    """Two versions behind: α = 1/2, so |p - b| = |θ - b| / 2 > 0 and w = e^(p - b) != 1."""
    backend, _ = _backend(tiny_model_dir, prox_logp=ProxLogp.loglinear)
    metrics = backend.train_step(make_batch(version=3, versions_behind=2))
    assert metrics["train/prox_behav_abs_diff"] > 0.1
    assert metrics["ppo/behav_weight_mean"] != pytest.approx(1.0)


def test_current_is_the_recomputed_proximal_policy_without_its_pass(tiny_model_dir):
    """One minibatch: the gradient pass runs the pre-step weights, so p = θ (r = 1, nothing
    clipped) and w = e^(θ - b) as with the recompute, from one forward per micro-batch."""
    batch = make_batch(version=3, versions_behind=2)
    current, calls = _backend(tiny_model_dir, prox_logp=ProxLogp.current)
    got = current.train_step(batch)
    want = _backend(tiny_model_dir, prox_logp=ProxLogp.recompute)[0].train_step(batch)
    assert len(calls) == got["train/num_microbatches"]
    assert got["ppo/ratio_mean"] == 1.0 and got["ppo/clip_fraction"] == 0.0
    for key in ("train/loss", "train/grad_norm", "train/prox_behav_abs_diff", "ppo/behav_weight_mean"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key


def test_current_with_minibatches_recomputes_only_the_later_minibatches(tiny_model_dir):
    """Two minibatches: the first one's gradient pass supplies its own p; the second's samples
    get the no-grad pass before the first optimiser step. The step equals recompute's."""
    batch = make_batch(version=3, versions_behind=2)
    current, calls = _backend(tiny_model_dir, ppo_minibatches=2)
    got = current.train_step(batch)
    recompute, recompute_calls = _backend(tiny_model_dir, ppo_minibatches=2, prox_logp=ProxLogp.recompute)
    want = recompute.train_step(batch)
    assert got["train/num_minibatches"] == 2
    # fewer forwards than recompute (its pass covers every sample), more than none at all
    assert got["train/num_microbatches"] < len(calls) < len(recompute_calls)
    for key in (
        "train/loss",
        "train/grad_norm",
        "train/prox_behav_abs_diff",
        "ppo/clip_fraction",
        "ppo/ratio_mean",
    ):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    for a, b in zip(current.model.parameters(), recompute.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_a_behaviour_log_prob_of_minus_inf_gives_a_finite_proximal_loss_and_gradient(dtype):
    """b = [-inf, -1], θ = [-2, -1], sampled at version 5 by a trainer at 5 (α = 0) and at 3 (α =
    1/2): p holds b within ±20 of θ (the recomputed path's behaviour-weight bound), so p and the
    loss and gradient are finite; before, -inf + α·inf and -inf - (-inf) were NaN. A real b is kept
    bit for bit."""
    behav = torch.tensor([-float("inf"), -1.0], dtype=dtype)
    theta = torch.tensor([-2.0, -1.0], dtype=dtype, requires_grad=True)
    for versions in (torch.tensor([5, 5]), torch.tensor([3, 3])):
        prox = loglinear_prox_logp(behav, theta, versions, 5)
        assert torch.isfinite(prox).all(), prox
        assert float(prox[1]) == -1.0
        algo = AlgoConfig(batch_size=1, group_size=2, decoupled=True, prox_logp=ProxLogp.loglinear)
        weight = torch.full((2,), 0.5, dtype=dtype)
        loss, stats = ppo_loss(theta, prox, behav, torch.ones(2, dtype=dtype), weight, torch.arange(2), algo)
        (grad,) = torch.autograd.grad(loss, theta)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (loss, grad)
        assert math.isfinite(stats.behav_weight_sum) and math.isfinite(stats.abs_diff_sum)
