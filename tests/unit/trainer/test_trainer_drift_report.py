"""algo.max_staleness=auto, the trainer's half: each step's drift goes to the controller as a
DriftReport (only steps that measured it), and the bound the controller reports with the new
version becomes the step's `staleness/bound` metric and the progress bar's `eta`."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from test_trainer_inbox import ScriptedChannel
from test_trainer_publisher_retry import Stage, publisher

from areal_jobs.config import AlgoConfig
from areal_jobs.config.algo import DriftMeasure
from areal_jobs.staleness_bound import drift_of
from areal_jobs.trainer.loop import TrainLoop
from areal_jobs.transport import messages as m
from launch.run.local import _postfix

MEASURED = {"offpolicy/measured_fraction": 1.0, "offpolicy/preclip_fraction": 0.07, "offpolicy/ess": 0.8}


class Sent:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


def report(algo: AlgoConfig, metrics: dict, lags=(2, 3, 4)) -> list:
    loop = SimpleNamespace(algo=algo, inbox=Sent(), version=6)
    batch = SimpleNamespace(staleness=lambda: np.asarray(lags, dtype=np.int64))
    TrainLoop._report_drift(loop, metrics, batch)
    return loop.inbox.sent


def test_each_measured_step_reports_its_drift_and_lag_under_auto():
    (msg,) = report(AlgoConfig(max_staleness="auto"), MEASURED)
    assert msg == m.DriftReport(version=7, drift=0.07, staleness_mean=3.0)
    (msg,) = report(AlgoConfig(max_staleness="auto", staleness_drift=DriftMeasure.ess), MEASURED)
    assert abs(msg.drift - 0.2) < 1e-12  # 1 - ESS


def test_nothing_is_reported_for_a_fixed_bound_or_an_unmeasured_step():
    assert report(AlgoConfig(max_staleness=8), MEASURED) == []
    # no token had π_pre: its shares read 0, which is no measurement (not a calm step)
    unmeasured = {**MEASURED, "offpolicy/measured_fraction": 0.0, "offpolicy/preclip_fraction": 0.0}
    assert report(AlgoConfig(max_staleness="auto"), unmeasured) == []
    assert drift_of({**MEASURED, "offpolicy/preclip_fraction": float("nan")}, DriftMeasure.preclip) is None


def test_the_bound_in_force_is_a_step_metric_and_on_the_progress_bar():
    paused = m.Paused(version=3, world_size=1, init_group=False, group_generation=1)
    controller = ScriptedChannel(paused, m.VersionPublished(version=3, update_s=0.1, staleness_bound=2))
    metrics = publisher(controller, Stage(failures=0)).publish(3, backend=None, trained=())
    assert metrics["staleness/bound"] == 2.0
    assert _postfix(metrics)["eta"] == "2"
    # a controller that reports no bound (-1) adds no metric
    controller = ScriptedChannel(paused, m.VersionPublished(version=3, update_s=0.1))
    assert "staleness/bound" not in publisher(controller, Stage(failures=0)).publish(3, None, ())
