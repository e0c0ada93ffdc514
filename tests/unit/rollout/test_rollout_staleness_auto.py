"""algo.max_staleness=auto through the real controller (an in-process fake server): the trainer's
high drift lowers the admission bound, the groups admitted under the old bound still train (the
trainer's freshness check keeps the ceiling) and admission waits until they have drained; the
DriftReport reaches the law through the service; the bound survives a snapshot and restore."""

from __future__ import annotations

import asyncio

from areal_jobs.config import AlgoConfig, RolloutConfig
from areal_jobs.rollout.controller import RolloutController
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.rollout.service import ControllerService
from areal_jobs.rollout.snapshot import load_snapshot, save_snapshot
from areal_jobs.rollout.weight_update import WeightUpdateOrchestrator
from areal_jobs.trainer.intake.batch import split_fresh
from areal_jobs.transport import messages as m

from .fake_server import FakeServer, ZeroScorer
from .test_rollout_controller_logic import Stream, until

B, G, CEILING = 2, 2, 4


def auto_algo(**kw) -> AlgoConfig:
    knobs = dict(staleness_ceiling=CEILING, staleness_window_steps=1, staleness_drift_target=0.03)
    return AlgoConfig(batch_size=B, group_size=G, max_staleness="auto", **{**knobs, **kw})


def make(algo: AlgoConfig):
    pool = ServerPool()
    pool.add(0, FakeServer("a", answer_len=lambda ids: 10))
    pushed: list[m.TrajectoryGroup] = []

    async def push(group):
        pushed.append(group)

    ctl = RolloutController(
        RolloutConfig(max_new_tokens=16, max_concurrent=64), algo, pool, ZeroScorer(), Stream(),
        decode=lambda ids: "x", push=push,
    )  # fmt: skip
    return ctl, pool, pushed


def test_high_drift_lowers_the_bound_and_the_backlog_drains_before_new_admissions():
    async def go():
        ctl, _, pushed = make(auto_algo())
        assert ctl.staleness_bound == CEILING  # the law starts at the ceiling
        task = asyncio.create_task(ctl.admission_loop())
        await until(lambda: len(pushed) == (CEILING + 1) * B)  # generation ran ahead: 10 groups
        # step 1 measured 50% pre-clipped tokens at lag 4: the bound falls to floor(4 * 0.03 / 0.5) = 0
        ctl.on_drift(1, 0.5, 4.0)
        assert ctl.staleness_bound == 0 and ctl.metrics()["rollout/staleness_bound"] == 0.0
        ctl.on_drift(1, 0.0, 0.0)  # the same version again (a resent report): no second update
        assert ctl.bound_law.drifts[-1] == 0.5
        # the groups admitted under eta = 4 are not thrown away: the trainer's check keeps the ceiling
        fresh, expired = split_fresh(list(pushed), 4, ctl.algo.max_staleness)
        assert len(fresh) == len(pushed) and not expired
        # the trainer works through the backlog; admission resumes only once it has (version 5)
        for version in range(1, 5):
            ctl.on_trained(tuple(g.group_id for g in pushed[(version - 1) * B : version * B]), version)
            ctl.on_version(version)
            await asyncio.sleep(0.1)
            assert len(pushed) == (CEILING + 1) * B and ctl.staleness.state.running == 0
        ctl.on_version(5)
        await until(lambda: len(pushed) == (CEILING + 1) * B + B)  # one batch: synchronous now
        await asyncio.sleep(0.1)
        assert len(pushed) == (CEILING + 1) * B + B
        await ctl.stop()
        task.cancel()

    asyncio.run(go())


def test_a_fixed_bound_ignores_drift_reports():
    ctl, _, _ = make(AlgoConfig(batch_size=B, group_size=G, max_staleness=3))
    ctl.on_drift(1, 0.9, 3.0)
    assert ctl.bound_law is None and ctl.staleness_bound == 3


class ScriptedChannel:
    has_peer = True

    def __init__(self, script: list) -> None:
        self.script, self.sent = list(script), []

    async def recv_control(self, timeout_s: float):
        return self.script.pop(0) if self.script else None

    async def send_control(self, msg) -> None:
        self.sent.append(msg)


def test_the_service_hands_the_trainers_drift_report_to_the_law():
    ctl, pool, _ = make(auto_algo())
    channel = ScriptedChannel([m.DriftReport(1, 0.06, 4.0), m.Stop("done", final_eval=False)])
    svc = ControllerService(
        ctl, pool, WeightUpdateOrchestrator(pool, ctl.rollout.pause_mode, 5.0), channel, [],
        eval_every_steps=0, step_timeout_s=5.0,
    )  # fmt: skip
    assert asyncio.run(asyncio.wait_for(svc._serve(), 20)) == 0
    assert ctl.staleness_bound == 2  # floor(4 * 0.03 / 0.06)
    (stopped,) = [msg for msg in channel.sent if isinstance(msg, m.Stopped)]
    assert stopped.metrics["rollout/staleness_bound"] == 2.0


def test_the_bound_and_the_laws_state_survive_a_snapshot(tmp_path):
    ctl, _, _ = make(auto_algo(staleness_hold_steps=3))
    ctl.on_drift(1, 0.06, 4.0)
    ctl.on_drift(2, 0.001, 4.0)
    save_snapshot(ctl.snapshot(step=2), tmp_path)
    again, _, _ = make(auto_algo(staleness_hold_steps=3))
    assert again.staleness_bound == CEILING
    again.restore(load_snapshot(tmp_path))
    assert again.staleness_bound == ctl.staleness_bound == 2
    assert again.bound_law.state_dict() == ctl.bound_law.state_dict()
    again.on_drift(2, 0.9, 2.0)  # already taken before the snapshot
    assert again.bound_law.state_dict() == ctl.bound_law.state_dict()
    for version in range(3, 30):  # both go on identically
        assert again.on_drift(version, 0.001, 2.0) is None
        ctl.on_drift(version, 0.001, 2.0)
        assert again.staleness_bound == ctl.staleness_bound
    assert ctl.staleness_bound > 2  # calm drift raised it again
