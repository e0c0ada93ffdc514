"""algo.max_staleness=auto: the control law (areal_jobs/staleness_bound.py) against a plant that admits
as the controller does: at version v, batches are admitted up to (eta + v + 1) at once (generation
runs ahead of the trainer), and the trainer at v trains batch v, whose lag is v - its admission
version. The drift is a function of that lag (linear, as measured: docs/objective.md)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from areal_jobs.staleness_bound import MAX_BACKOFF, BoundParams, StalenessBoundLaw


def run_plant(law: StalenessBoundLaw, drift_of, steps: int):
    """(bounds after each step, lags trained, drifts measured). `drift_of(lag, version)`."""
    admitted: list[int] = []
    bounds, lags, drifts = [], [], []
    for v in range(steps):
        while len(admitted) < law.bound + v + 1:
            admitted.append(v)
        lag = v - admitted[v]
        d = drift_of(lag, v)
        law.update(d, lag)
        bounds.append(law.bound)
        lags.append(lag)
        drifts.append(d)
    return bounds, lags, drifts


def direction_changes(bounds: list[int]) -> int:
    moves = [b - a for a, b in zip(bounds, bounds[1:]) if b != a]
    return sum(1 for x, y in zip(moves, moves[1:]) if (x > 0) != (y > 0))


P = BoundParams(ceiling=8, target=0.03, raise_below=0.5, hold_steps=10, window_steps=5)


def test_step_up_in_drift_cuts_the_bound_to_the_level_that_brings_it_back():
    # low drift: the bound stays at the ceiling and the trained lag reaches it
    slope = {"c": 0.001}
    law = StalenessBoundLaw(P)
    bounds, lags, drifts = run_plant(law, lambda lag, v: slope["c"] * lag, 60)
    assert set(bounds) == {8} and lags[-1] == 8
    # the drift per version jumps 25x: 0.2 at lag 8, the target (0.03) is reached at lag 1.2
    slope["c"] = 0.2 / 8
    after, lags2, drifts2 = run_plant_continue(law, lambda lag, v: slope["c"] * lag, 60, start=60)
    level = math.floor(P.target / slope["c"])  # 1: the largest lag whose drift is <= target
    assert after[-1] == level
    assert min(after) == level  # no overshoot below it
    assert all(b2 <= b1 for b1, b2 in zip([8, *after], after))  # it only falls
    first_at_level = after.index(level)
    assert first_at_level < 8 + P.window_steps + 2  # two proportional cuts, one dead time apart
    # once the backlog has drained, every batch trains at the new lag and the drift is back under T
    settled = drifts2[first_at_level + 8 + 1 :]
    assert settled and max(settled) <= P.target


def run_plant_continue(law, drift_of, steps, start):
    """run_plant from version `start` on (the plant's queue rebuilt: every batch admitted up to
    the bound, as in steady state)."""
    admitted = [max(0, k - law.bound) for k in range(start + law.bound + 1)]
    bounds, lags, drifts = [], [], []
    for v in range(start, start + steps):
        while len(admitted) < law.bound + v + 1:
            admitted.append(v)
        lag = v - admitted[v]
        d = drift_of(lag, v)
        law.update(d, lag)
        bounds.append(law.bound)
        lags.append(lag)
        drifts.append(d)
    return bounds, lags, drifts


def test_low_drift_raises_the_bound_to_the_ceiling_at_the_designed_rate():
    law = StalenessBoundLaw(P)
    high = {"on": True}
    bounds, _, _ = run_plant(law, lambda lag, v: 1.0 if high["on"] else 0.0, 30)
    assert bounds[-1] == P.floor == 0
    high["on"] = False
    bounds, _, _ = run_plant_continue(law, lambda lag, v: 0.0, 200, start=30)
    assert bounds[-1] == P.ceiling and max(bounds) == P.ceiling
    raises = [i for i in range(1, len(bounds)) if bounds[i] > bounds[i - 1]]
    assert [bounds[i] - bounds[i - 1] for i in raises] == [1] * P.ceiling  # one version at a time
    # between raises: the dead time of the last one (its bound + W), or H calm steps if longer
    for i, j in zip(raises, raises[1:]):
        b = bounds[i]
        assert j - i == max(b + P.window_steps, P.hold_steps)
    # designed ramp floor -> ceiling after the first raise: sum over b = 1..7 of max(b + 5, 10)
    assert raises[-1] - raises[0] == sum(max(b + 5, 10) for b in range(1, 8))


def test_no_oscillation_on_a_noisy_drift_around_the_target():
    rng = np.random.default_rng(7)
    slope = P.target / 3  # the target is met exactly at lag 3
    law = StalenessBoundLaw(P)
    noisy = lambda lag, v: max(0.0, slope * lag * (1 + 0.3 * rng.standard_normal()))  # noqa: E731
    bounds, lags, _ = run_plant(law, noisy, 2000)
    tail = bounds[200:]
    # the bound settles in [2, 3] (3 is exactly at the target) and moves rarely
    assert set(tail) <= {2, 3}
    assert direction_changes(bounds) <= 20
    assert law.changes <= 25
    # the same signal through a law without hysteresis (raise as soon as the mean is below the
    # target, no hold, one-step mean) turns around far more often: the count above can fail
    jumpy = StalenessBoundLaw(
        BoundParams(ceiling=8, target=0.03, raise_below=0.99, hold_steps=1, window_steps=1)
    )
    rng = np.random.default_rng(7)
    jumpy_bounds, _, _ = run_plant(jumpy, noisy, 2000)
    assert direction_changes(jumpy_bounds) > 3 * direction_changes(bounds)


def test_a_raise_cut_back_at_once_is_retried_ever_more_rarely():
    """Lag 1 already exceeds the target, lag 0 is calm: the only dither a discrete bound allows.
    The back-off doubles H after each failed raise, so the tries thin out."""
    law = StalenessBoundLaw(P)
    bounds, _, _ = run_plant(law, lambda lag, v: 0.1 * lag, 3000)
    raises = [i for i in range(1, len(bounds)) if bounds[i] > bounds[i - 1]]
    gaps = np.diff(raises)
    assert all(g2 >= g1 for g1, g2 in zip(gaps, gaps[1:]))
    # the waits double up to MAX_BACKOFF x H (then one try per ~170 steps: a drift that falls for
    # good is still found); without the back-off, one try every 2 dead times + H (~30 steps)
    assert gaps[-1] >= MAX_BACKOFF * P.hold_steps and len(raises) <= 25
    assert set(bounds[50:]) <= {0, 1}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bounds_are_respected_whatever_the_signal(seed):
    rng = np.random.default_rng(seed)
    p = BoundParams(ceiling=6, floor=2, target=0.05, hold_steps=3, window_steps=2)
    law = StalenessBoundLaw(p)
    for _ in range(3000):
        kind = rng.integers(4)
        drift = [float("nan"), 0.0, float(rng.exponential(0.05)), float(rng.uniform(0, 1))][kind]
        lag = None if rng.random() < 0.2 else float(rng.uniform(0, 10))
        assert p.floor <= law.update(drift, lag) <= p.ceiling


def test_deterministic_and_resumable_from_its_state():
    noise = np.random.default_rng(3).standard_normal(800)
    drift_of = lambda lag, v: max(0.0, 0.01 * lag * (1 + 0.5 * noise[v]))  # noqa: E731
    full, _, _ = run_plant(StalenessBoundLaw(P), drift_of, 800)
    again, _, _ = run_plant(StalenessBoundLaw(P), drift_of, 800)
    assert full == again
    # a checkpoint and a resume mid-run, the state through JSON as the snapshot stores it
    law = StalenessBoundLaw(P)
    admitted: list[int] = []
    resumed = []
    for v in range(800):
        if v == 400:
            state = json.loads(json.dumps(law.state_dict()))
            law = StalenessBoundLaw(P)
            law.load_state_dict(state)
        while len(admitted) < law.bound + v + 1:
            admitted.append(v)
        lag = v - admitted[v]
        resumed.append(law.update(drift_of(lag, v), lag))
    assert resumed == full
    assert len(set(full)) > 2 and direction_changes(full) >= 1  # the signal moved the bound


def test_missing_measurements_change_nothing_but_the_dead_time_runs():
    law = StalenessBoundLaw(P)
    for _ in range(P.window_steps):
        law.update(0.5, 8.0)
    assert law.bound == 7 or law.bound < 8  # cut on the fifth measurement
    cut_to, frozen = law.bound, law.frozen_steps
    for _ in range(frozen):
        assert law.update(None) == cut_to and law.update(float("nan")) == cut_to
    assert law.frozen_steps == 0 and list(law.drifts) == [0.5] * P.window_steps


def test_params_are_checked():
    with pytest.raises(ValueError):
        BoundParams(ceiling=0)
    with pytest.raises(ValueError):
        BoundParams(ceiling=4, floor=4)
    with pytest.raises(ValueError):
        BoundParams(ceiling=4, raise_below=1.0)
