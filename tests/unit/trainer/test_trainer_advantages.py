"""GRPO, Dr.GRPO and RLOO advantages against their definitions."""

import numpy as np
import pytest

from areal_jobs.config import Advantage
from areal_jobs.trainer.advantages import group_advantages, is_uniform


def test_grpo_is_mean_centred_and_std_normalised():
    r = np.array([1.0, 0.0, 0.0, 1.0, 1.0])
    adv = group_advantages(r, Advantage.grpo)
    np.testing.assert_allclose(adv, (r - r.mean()) / (r.std() + 1e-6), rtol=1e-6)
    assert abs(adv.mean()) < 1e-6


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
