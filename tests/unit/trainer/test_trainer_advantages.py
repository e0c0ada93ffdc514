"""GRPO, Dr.GRPO and RLOO advantages against their definitions."""

import numpy as np
import pytest

from areal_jobs.config import Advantage
from areal_jobs.config.algo import AdvStd
from areal_jobs.trainer.objective.advantages import group_advantages, is_uniform, overlong_penalty, whiten


def test_grpo_is_mean_centred_and_std_normalised():
    # r = 1,0,0,1,1: mean 0.6; squared deviations 0.16 x3 + 0.36 x2 = 1.2
    # unbiased std sqrt(1.2 / 4) = 0.5477226, biased sqrt(1.2 / 5) = 0.4898979
    r = np.array([1.0, 0.0, 0.0, 1.0, 1.0])
    adv = group_advantages(r, Advantage.grpo)
    np.testing.assert_allclose(adv[:2], [0.4 / (0.5477226 + 1e-5), -0.6 / (0.5477226 + 1e-5)], rtol=1e-6)
    assert abs(adv.mean()) < 1e-6
    biased = group_advantages(r, Advantage.grpo, AdvStd.biased, eps=1e-6)
    np.testing.assert_allclose(biased[:2], [0.4 / (0.4898979 + 1e-6), -0.6 / (0.4898979 + 1e-6)], rtol=1e-6)


def test_near_constant_group_is_damped_by_eps():
    # r = 0,0,0,1e-6: mean 2.5e-7; unbiased std sqrt((3 * 6.25e-14 + 5.625e-13) / 3) = 5e-7
    r = np.array([0.0, 0.0, 0.0, 1e-6])
    adv = group_advantages(r, Advantage.grpo)
    np.testing.assert_allclose(adv, [-2.5e-7 / 1.05e-5] * 3 + [7.5e-7 / 1.05e-5], rtol=1e-5)
    # biased std sqrt(7.5e-13 / 4) = 4.330127e-7
    biased = group_advantages(r, Advantage.grpo, AdvStd.biased)
    np.testing.assert_allclose(biased[3], 7.5e-7 / (4.330127e-7 + 1e-5), rtol=1e-5)


def test_batch_whitening_is_token_weighted():
    # advantages 1 (3 tokens) and -1 (1 token): mean (3 - 1) / 4 = 0.5;
    # unbiased token std sqrt((3 * 0.25 + 2.25) / 3) = 1
    out = whiten(np.array([1.0, -1.0]), np.array([3.0, 1.0]), eps=1e-5)
    np.testing.assert_allclose(out, [0.5 / (1 + 1e-5), -1.5 / (1 + 1e-5)], rtol=1e-6)


def test_overlong_penalty_grows_linearly_over_the_buffer():
    assert overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert overlong_penalty(90, 100, 20, 1.0) == pytest.approx(0.5)
    assert overlong_penalty(100, 100, 20, 0.5) == pytest.approx(0.5)
    assert overlong_penalty(100, 100, 0, 1.0) == 0.0


def test_drgrpo_skips_the_std():
    r = np.array([3.0, 1.0, 2.0])
    np.testing.assert_allclose(group_advantages(r, Advantage.drgrpo), [1.0, -1.0, 0.0])


def test_rloo_is_reward_minus_mean_of_the_others():
    r = np.array([1.0, 0.0, 0.5, 0.25])
    expected = [r[i] - np.delete(r, i).mean() for i in range(4)]
    np.testing.assert_allclose(group_advantages(r, Advantage.rloo), expected, rtol=1e-6)


@pytest.mark.parametrize("kind", list(Advantage))
def test_uniform_rewards_give_exactly_zero(kind):
    r = np.full(6, 0.7)
    assert is_uniform(r)
    assert np.all(group_advantages(r, kind) == 0.0)


def test_bad_input():
    with pytest.raises(ValueError):
        group_advantages(np.array([]), Advantage.grpo)
    with pytest.raises(ValueError, match="RLOO"):
        group_advantages(np.array([1.0]), Advantage.rloo)
