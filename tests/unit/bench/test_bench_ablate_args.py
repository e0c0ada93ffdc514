"""`python -m bench.ablate`'s defaults are the paper's regime (4 minibatches, behaviour weight
capped at 5), each replaced by an override of the same key; --lock holds the flock per run."""

import fcntl

import pytest

from bench.ablate import _held, parse_args


def test_defaults_are_four_minibatches_and_a_capped_behaviour_weight():
    args = parse_args([])
    assert "algo.ppo_minibatches=4" in args.overrides and "algo.behav_weight_cap=5" in args.overrides
    args = parse_args(["algo.ppo_minibatches=1", "trainer.lr=6e-4"])
    assert "algo.ppo_minibatches=1" in args.overrides and "algo.ppo_minibatches=4" not in args.overrides
    assert "algo.behav_weight_cap=5" in args.overrides and args.lock is None


def test_lock_is_held_during_a_run_and_released_after(tmp_path):
    lock = tmp_path / "heavy.lock"
    with _held(lock), open(lock) as other:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again
    with _held(None):
        pass
