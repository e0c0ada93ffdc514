"""The pre-clipped share warning (trainer/objective/staleness_watch.py), the config that sets it and the
progress bar's field, by hand."""

from __future__ import annotations

import math

import pytest

from areal_jobs.config.job import RunConfig
from areal_jobs.trainer.objective.staleness_watch import PRECLIP_KEY, PreclipWatch
from launch.run.local import _postfix


def feed(watch: PreclipWatch, values: list[float]) -> list[int]:
    """The steps (1-based) at which the watch warned."""
    return [step for step, v in enumerate(values, 1) if watch.update(step, {PRECLIP_KEY: v})]


def test_warns_once_the_mean_of_the_window_passes_the_threshold():
    # the window's mean: 0.04 at step 5, then 0.08, 0.12 at step 7 (> 0.10)
    assert feed(PreclipWatch(0.10), [0.0, 0.0, 0.0, 0.1, 0.1, 0.2, 0.2, 0.2]) == [7]
    # one noisy batch among quiet ones says nothing (its 0.4 is 0.08 of the window's mean),
    # and nothing is said before the window is full
    assert feed(PreclipWatch(0.10), [0.4, 0.0, 0.0, 0.0, 0.0, 0.0]) == []
    assert feed(PreclipWatch(0.10), [0.9, 0.9, 0.9, 0.9]) == []


def test_after_a_warning_it_stays_silent_until_the_mean_falls_below_half_the_threshold():
    watch = PreclipWatch(0.10, window_steps=1)
    assert feed(watch, [0.2, 0.3, 0.06, 0.2, 0.04, 0.2]) == [1, 6]  # 0.06 is not below 0.05: no re-arm


def test_unmeasured_steps_are_skipped_and_the_message_names_what_to_change():
    watch = PreclipWatch(0.10, window_steps=2)
    assert watch.update(1, {PRECLIP_KEY: 0.5}) is None
    assert watch.update(2, {PRECLIP_KEY: math.nan}) is None and watch.update(3, {}) is None
    text = watch.update(4, {PRECLIP_KEY: 0.3, "offpolicy/abs_log_w_p99": 7.17, "offpolicy/ess": 0.77})
    assert text is not None and "40.0%" in text and "|log w| p99 7.17" in text and "ESS 0.77" in text
    assert "trainer.lr" in text and "algo.max_staleness" in text and "run.preclip_warn_fraction=0" in text
    assert "already naive PPO" in text  # the default since issue 42: nothing else to switch to
    decoupled = PreclipWatch(0.10, window_steps=1, objective="decoupled")
    text = decoupled.update(1, {PRECLIP_KEY: 0.3})
    assert "algo.objective=decoupled" in text and "algo.objective=ppo" in text  # the one that held


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5])
def test_the_threshold_must_be_a_share(bad):
    with pytest.raises(ValueError):
        PreclipWatch(bad)


def test_run_config_refuses_a_share_outside_0_1_naming_the_override():
    assert (
        RunConfig().preclip_warn_fraction == 0.10
        and RunConfig(preclip_warn_fraction=0).preclip_warn_fraction == 0
    )
    with pytest.raises(ValueError, match=r"run\.preclip_warn_fraction=1\.5"):
        RunConfig(preclip_warn_fraction=1.5)


def test_the_progress_bar_shows_the_pre_clipped_share_when_measured():
    assert _postfix({"reward/mean": 0.5, PRECLIP_KEY: 0.0123})["preclip"] == "1.2%"
    assert "preclip" not in _postfix({"reward/mean": 0.5, PRECLIP_KEY: math.nan})
    assert "preclip" not in _postfix({"reward/mean": 0.5})
