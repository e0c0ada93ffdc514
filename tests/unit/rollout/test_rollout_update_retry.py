"""A server that dies inside a weight update leaves the pool and the version is sent again to the
others; the run goes on. The controller's side of it (ControllerService._update_weights), with
scripted servers; the real servers and trainer are in tests/integration/e2e/test_e2e_faults.py."""

from __future__ import annotations

import asyncio

import pytest

from areal_jobs.api import Health, WeightSender
from areal_jobs.config import PauseMode
from areal_jobs.rollout import update_steps as update_steps_mod
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.rollout.service import ControllerService
from areal_jobs.rollout.weight_update import StageError, WeightUpdateOrchestrator
from areal_jobs.transport import messages as m

from .test_rollout_weight_update import SENDER, DiesAtBucket, Healthy


class Channel:
    has_peer = True

    def __init__(self) -> None:
        self.sent: list = []

    async def send_control(self, msg) -> None:
        self.sent.append(msg)


class Controller:
    """What the update touches of the rollout controller."""

    def __init__(self) -> None:
        self.running = asyncio.Event()
        self.running.set()
        self.version = 0
        self.staleness_bound = 4  # the admission bound VersionPublished reports

    def on_trained(self, group_ids, version=None) -> None:
        pass

    def stop_sending(self) -> None:
        self.running.clear()

    def resume_sending(self) -> None:
        self.running.set()

    def on_version(self, version: int) -> None:
        self.version = version


def service(clients):
    pool = ServerPool()
    for i, c in enumerate(clients):
        pool.add(i, c)
    orch = WeightUpdateOrchestrator(pool, PauseMode.in_place, step_timeout_s=5.0)
    ctl, channel = Controller(), Channel()
    svc = ControllerService(ctl, pool, orch, channel, [], eval_every_steps=0, step_timeout_s=5.0)
    return svc, pool, ctl, channel


REQUEST = m.PauseRequest(version=5, senders=(SENDER,), backend="gloo", trained_group_ids=())


def test_a_server_dying_mid_broadcast_is_dropped_and_the_version_sent_again():
    survivor, victim = Healthy("a"), DiesAtBucket("b")
    svc, pool, ctl, channel = service([survivor, victim])

    asyncio.run(svc._update_weights(REQUEST))
    paused, retry = channel.sent
    assert paused == m.Paused(version=5, world_size=3, init_group=True, group_generation=1)
    assert isinstance(retry, m.UpdateRetry) and retry.version == 5 and retry.lost_servers == (1,)
    assert "server 1" in retry.stage
    assert not pool.slots[1].up and pool.slots[0].up
    # the survivor stays paused, holding its requests, and nothing new is sent: no mixed weights
    assert ("resume",) not in survivor.calls and not ctl.running.is_set() and ctl.version == 0

    survivor.calls.clear()
    asyncio.run(svc._update_weights(REQUEST))  # the trainer asks again
    paused, published = channel.sent[2:]
    assert paused == m.Paused(version=5, world_size=2, init_group=True, group_generation=2)
    assert isinstance(published, m.VersionPublished) and published.version == 5
    assert not any(c[0] == "pause" for c in survivor.calls)  # still paused from the first attempt
    assert [c[:3] for c in survivor.calls if c[0] == "bucket"] == [("bucket", "w-2", 5)] * 2
    assert ("resume",) in survivor.calls and ctl.running.is_set() and ctl.version == 5


def test_a_failure_with_every_server_alive_is_fatal():
    class Refuses(Healthy):
        async def begin_weight_update(self):
            raise ValueError("HTTP 400: weights of the wrong shape")

    svc, pool, _, channel = service([Healthy("a"), Refuses("b")])
    with pytest.raises(StageError, match="begin weight update on server 1"):
        asyncio.run(svc._update_weights(REQUEST))
    assert isinstance(channel.sent[-1], m.UpdateFailed) and all(s.up for s in pool.slots.values())


def test_retries_of_one_version_are_bounded(monkeypatch):
    monkeypatch.setattr(update_steps_mod, "MAX_UPDATE_RETRIES", 1)
    svc, pool, _, channel = service([Healthy("a"), DiesAtBucket("b"), DiesAtBucket("c")])
    pool.mark_down(2, "not yet")  # c joins the second attempt only ...
    asyncio.run(svc._update_weights(REQUEST))
    assert isinstance(channel.sent[-1], m.UpdateRetry)
    pool.slots[2].up = True  # ... and dies in it too: a second loss in one version is fatal here
    with pytest.raises(StageError):
        asyncio.run(svc._update_weights(REQUEST))
    assert isinstance(channel.sent[-1], m.UpdateFailed)


# ------------------------------------------------------------------ servers joining and leaving


def test_a_server_added_to_the_job_joins_at_the_next_update_and_one_asked_to_leave_drains():
    """launch.scale +1 / -1 as the controller sees it: a new registration is admitted like a
    restarted server (no request before an update gave it the weights); a server asked to leave
    gets no new request and leaves the pool once none of its requests is in flight."""
    from areal_jobs.transport.discovery import ServerRecord

    class Started(Healthy):
        async def healthy(self):
            return True  # not paused: a fresh server answers /health

    svc, pool, _, channel = service([Healthy("a"), Healthy("b")])
    records = [
        ServerRecord(0, "127.0.0.1", 1),
        ServerRecord(1, "127.0.0.1", 2),
        ServerRecord(2, "127.0.0.1", 3),
    ]
    leaving: set[int] = set()
    drained: list[int] = []
    svc.discover, svc.make_client = (lambda: records), (lambda rec: Started(f"new{rec.index}"))
    svc.leaving, svc.on_drained = (lambda: leaving), drained.append

    asyncio.run(svc._membership())
    assert pool.slots[2].joining and not pool.slots[2].up
    assert channel.sent == [m.WeightsNeeded(reason="server 2 joined")]
    assert pool.least_loaded().index in (0, 1)  # no work before the weights
    asyncio.run(svc._update_weights(REQUEST))
    assert pool.slots[2].up and ("bucket", "w-1", 5, 1) in pool.slots[2].client.calls

    leaving.add(1)
    pool.slots[1].in_flight = 1  # a request still on it
    asyncio.run(svc._membership())
    assert pool.slots[1].draining and drained == []
    assert {pool.least_loaded().index for _ in range(3)} <= {0, 2}
    pool.slots[1].in_flight = 0
    asyncio.run(svc._membership())
    assert 1 not in pool.slots and drained == [1]
    asyncio.run(svc._membership())  # its registration may linger: it is not admitted again
    assert 1 not in pool.slots and drained == [1]

    records.append(ServerRecord(3, "127.0.0.1", 4))  # registers after it was asked to leave
    leaving.add(3)
    asyncio.run(svc._membership())
    asyncio.run(svc._membership())
    assert 3 not in pool.slots and drained == [1, 3]  # never admitted, answered once


# ------------------------------------------------------------------ slow, not dead (issue 32)


class SlowFirstBegin(Healthy):
    """A server that answers, but whose first begin_weight_update takes far longer than the
    stage timeout (a starved node): it lags behind the other server."""

    def __init__(self, name):
        super().__init__(name)
        self.begins = 0

    async def begin_weight_update(self):
        self.begins += 1
        await self._call("begin")
        if self.begins == 1:
            await asyncio.sleep(3600)


def slow_service(clients, step_timeout_s=0.2):
    svc, pool, ctl, channel = service(clients)
    svc.orch.step_timeout_s = step_timeout_s
    return svc, pool, ctl, channel


def test_a_stage_that_times_out_with_every_server_alive_is_sent_again_with_longer_timeouts():
    fast, slow = Healthy("a"), SlowFirstBegin("b")
    svc, pool, ctl, channel = slow_service([fast, slow])
    asyncio.run(asyncio.wait_for(svc._update_weights(REQUEST), 30))
    paused, retry = channel.sent
    assert paused.timeout_scale == 1.0
    assert (
        isinstance(retry, m.UpdateRetry) and retry.lost_servers == () and "begin weight update" in retry.stage
    )
    assert all(s.up for s in pool.slots.values())  # answering: nobody is dropped
    assert not ctl.running.is_set()  # still paused, holding their requests until the repeat is in
    asyncio.run(asyncio.wait_for(svc._update_weights(REQUEST), 30))  # the trainer asks again
    paused, published = channel.sent[2:]
    assert paused.timeout_scale == 2.0 and paused.init_group  # longer stage timeouts, fresh groups
    assert isinstance(published, m.VersionPublished) and ctl.version == 5 and ctl.running.is_set()
    assert svc.orch.timeout_scale == 1.0  # the next version starts over


def test_repeats_after_timeouts_are_bounded(monkeypatch):
    monkeypatch.setattr(update_steps_mod, "MAX_SLOW_UPDATE_RETRIES", 1)

    class AlwaysSlow(SlowFirstBegin):
        async def begin_weight_update(self):
            await self._call("begin")
            await asyncio.sleep(3600)

    svc, pool, ctl, channel = slow_service([Healthy("a"), AlwaysSlow("b")], step_timeout_s=0.1)
    asyncio.run(asyncio.wait_for(svc._update_weights(REQUEST), 30))
    assert isinstance(channel.sent[-1], m.UpdateRetry)
    with pytest.raises(StageError, match="begin weight update on server 1"):
        asyncio.run(asyncio.wait_for(svc._update_weights(REQUEST), 30))
    assert isinstance(channel.sent[-1], m.UpdateFailed)


class Probed(Healthy):
    """Health probes answered as scripted; `busy`: its metadata calls are answered all the same
    (generation slow or paused), else nothing is (stalled)."""

    def __init__(self, name, answers, busy=False):
        super().__init__(name)
        self.answers, self.busy = list(answers), busy

    async def health(self):
        return self.answers.pop(0) if self.answers else Health.up

    async def weight_version(self):
        if not self.busy:
            raise TimeoutError("no answer")
        return 0


def test_a_refused_health_probe_marks_the_server_down_at_once():
    svc, pool, _, _ = service([Probed("a", [Health.refused])])
    svc.health_grace_s = 3600
    asyncio.run(svc._probe(pool.slots[0]))
    assert not pool.slots[0].up


def test_unanswered_health_probes_mark_a_server_down_only_after_the_grace():
    clock = [1000.0]
    svc, pool, _, _ = service([Probed("a", [Health.no_answer] * 3 + [Health.up] + [Health.no_answer] * 2)])
    svc.health_grace_s, svc.clock = 60, lambda: clock[0]
    for t in (1000, 1030, 1059):  # stalled for 59 s: waited for
        clock[0] = t
        asyncio.run(svc._probe(pool.slots[0]))
        assert pool.slots[0].up
    clock[0] = 1070
    asyncio.run(svc._probe(pool.slots[0]))  # it answers again: the count starts over
    clock[0] = 1100
    asyncio.run(svc._probe(pool.slots[0]))
    assert pool.slots[0].up
    clock[0] = 1160
    asyncio.run(svc._probe(pool.slots[0]))  # 60 s unanswered since 1100
    assert not pool.slots[0].up


def test_a_trainer_that_dropped_its_group_gets_the_groups_formed_again():
    svc, pool, ctl, channel = service([Healthy("a")])
    asyncio.run(svc._update_weights(REQUEST))
    assert channel.sent[0].init_group and isinstance(channel.sent[1], m.VersionPublished)
    asyncio.run(svc._update_weights(m.PauseRequest(6, (SENDER,), "gloo")))
    assert not channel.sent[2].init_group  # the groups stand: reused
    asyncio.run(svc._update_weights(m.PauseRequest(7, (SENDER,), "gloo", regroup=True)))
    assert channel.sent[4].init_group and channel.sent[4].group_generation == 2


def test_a_server_whose_front_still_answers_is_busy_not_down():
    clock = [0.0]
    svc, pool, _, _ = service([Probed("a", [Health.no_answer] * 5, busy=True)])
    svc.health_grace_s, svc.clock = 60, lambda: clock[0]
    for t in range(0, 500, 100):
        clock[0] = t
        asyncio.run(svc._probe(pool.slots[0]))
        assert pool.slots[0].up


class TrainerWords(Channel):
    """The trainer's side of an encoded update: its BroadcastDone (or silence)."""

    def __init__(self, *words) -> None:
        super().__init__()
        self.words = list(words)

    async def recv_control(self, timeout_s=None):
        if self.words:
            return self.words.pop(0)
        await asyncio.sleep(0.01)
        return None


class EncodedHealthy(Healthy):
    async def receive_encoded_bucket(self, tensors, name, version, timeout_s=None):
        await self._call("encoded", name, version, len(tensors))


def test_an_encoded_update_ends_only_on_the_trainers_word():
    """weight_sync.sync=delta: SGLang's loader answers success even when the group broke under it,
    so the servers hold the version only once the trainer says its collectives all completed; a
    broken trainer side (every server alive) is a slow stage, sent again with longer timeouts."""
    encoded = m.PauseRequest(
        version=5,
        senders=(WeightSender(SENDER.group_name, "127.0.0.1", 1, SENDER.buckets, encoded=True),),
        backend="gloo",
    )
    stats = m.RolloutStats(metrics={})
    ok = m.BroadcastDone(5, True)
    broken = m.BroadcastDone(5, False, "bucket 2/2 (version 5): not acknowledged within 5s")
    for words, published in (((stats, ok), True), ((broken,), False)):
        svc, pool, ctl, _ = service([EncodedHealthy("a"), EncodedHealthy("b")])
        svc.channel = channel = TrainerWords(*words)
        asyncio.run(svc._update_weights(encoded))
        assert isinstance(channel.sent[-1], m.VersionPublished if published else m.UpdateRetry)
        # every call of theirs returned, but only the trainer's word makes them hold the version
        assert [s.held_version for s in pool.up_slots] == ([5, 5] if published else [-1, -1])
        assert ctl.version == (5 if published else 0)
        if published:
            assert svc._early == [stats]  # read while waiting: served by the loop next
        else:
            assert channel.sent[-1].lost_servers == () and svc.orch.timeout_scale == 2.0
