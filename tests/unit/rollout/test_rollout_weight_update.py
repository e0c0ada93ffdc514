"""The controller's handshake: every stage is named and bounded; group names are fresh per formation."""

from __future__ import annotations

import asyncio

import pytest

from areal_jobs.api import BucketSpec, TensorSpec, WeightSender
from areal_jobs.config import PauseMode
from areal_jobs.rollout import weight_update
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.rollout.weight_update import StageError, WeightUpdateOrchestrator


class Recorder:
    def __init__(self, name, hang_on=None):
        self.name, self.hang_on, self.calls = name, hang_on, []

    async def _call(self, what, *args):
        self.calls.append((what, *args))
        if what == self.hang_on:
            await asyncio.sleep(3600)

    async def pause(self, mode):
        await self._call("pause", mode)

    async def abort_all(self):
        await self._call("abort")

    async def resume(self):
        await self._call("resume")

    async def init_weights_update_group(self, addr, port, offset, world, name, backend, timeout_s=None):
        await self._call("init", offset, world, name)

    async def destroy_weights_update_group(self, name):
        await self._call("destroy", name)

    async def begin_weight_update(self):
        await self._call("begin")

    async def update_weights_from_distributed(self, tensors, name, version, timeout_s=None):
        await self._call("bucket", name, version, len(tensors))

    async def end_weight_update(self):
        await self._call("end")

    async def flush_cache(self):
        await self._call("flush")


SENDER = WeightSender(
    "w",
    "127.0.0.1",
    1,
    (BucketSpec(0, (TensorSpec("a", "float32", (1,)),)), BucketSpec(1, (TensorSpec("b", "float32", (1,)),))),
)


def orchestrator(clients, timeout_s=5.0, mode=PauseMode.abort):
    pool = ServerPool()
    for i, c in enumerate(clients):
        pool.add(i, c)
    return WeightUpdateOrchestrator(pool, mode, timeout_s), pool


def test_full_sequence_and_rank_offsets():
    a, b = Recorder("a"), Recorder("b")
    orch, _ = orchestrator([a, b])

    async def go():
        await orch.pause(lambda: 0)
        assert orch.needs_group_init((SENDER,))
        orch.next_generation()
        await orch.init_groups((SENDER,), "gloo")
        assert not orch.needs_group_init((SENDER,))
        await orch.receive(7, (SENDER,))
        await orch.resume()

    asyncio.run(go())
    assert [c[0] for c in a.calls] == ["abort", "init", "begin", "bucket", "bucket", "end", "flush", "resume"]
    assert a.calls[1] == ("init", 1, 3, "w-1") and b.calls[1] == ("init", 2, 3, "w-1")
    assert a.calls[3] == ("bucket", "w-1", 7, 1)


def test_reformed_groups_get_a_new_name_and_old_ones_are_destroyed():
    a = Recorder("a")
    orch, _ = orchestrator([a])

    async def go():
        for _ in range(2):
            orch.forget_groups()
            orch.next_generation()
            await orch.init_groups((SENDER,), "gloo")

    asyncio.run(go())
    assert ("destroy", "w-1") in a.calls and ("init", 1, 2, "w-2") in a.calls


def test_a_hung_server_fails_the_named_stage_within_the_timeout():
    orch, _ = orchestrator([Recorder("a"), Recorder("b", hang_on="bucket")], timeout_s=0.5)

    async def go():
        await orch.receive(3, (SENDER,))

    with pytest.raises(StageError, match=r"weight broadcast bucket 1/2 of sender w to server 1: timed out"):
        asyncio.run(asyncio.wait_for(go(), 10))


def test_a_failing_server_is_reported_with_its_stage():
    class Broken(Recorder):
        async def pause(self, mode):
            raise ConnectionError("server gone")

    orch, pool = orchestrator([Recorder("a"), Broken("b")], mode=PauseMode.in_place)
    asyncio.run(orch.pause(lambda: 0))  # one server left: the update goes on without the broken one
    assert pool.slots[0].up and not pool.slots[1].up
    orch, _ = orchestrator([Broken("a"), Broken("b")], mode=PauseMode.in_place)
    with pytest.raises(StageError, match="pause generation on server 0: ConnectionError: server gone"):
        asyncio.run(orch.pause(lambda: 0))


def test_failures_after_the_group_is_formed_are_fatal():
    class Broken(Recorder):
        async def begin_weight_update(self):
            raise ConnectionError("server gone")

    orch, _ = orchestrator([Recorder("a"), Broken("b")])
    with pytest.raises(StageError, match="begin weight update on server 1"):
        asyncio.run(orch.receive(1, (SENDER,)))


def test_a_server_that_dies_after_every_bucket_arrived_only_leaves_the_pool():
    """kill -9 during the end-of-update call (seen with vLLM's collective_rpc): the other servers
    hold the new weights, so the update completes without the dead one, which rejoins later."""

    class DiesAtEnd(Recorder):
        async def end_weight_update(self):
            raise ConnectionError("connection reset by peer")

    orch, pool = orchestrator([Recorder("a"), DiesAtEnd("b")])
    asyncio.run(orch.receive(1, (SENDER,)))
    assert pool.slots[0].up and not pool.slots[1].up
    assert ("flush",) in pool.slots[0].client.calls  # the survivor finished its update
    orch, _ = orchestrator([DiesAtEnd("a"), DiesAtEnd("b")])
    with pytest.raises(StageError, match="end weight update on server 0"):
        asyncio.run(orch.receive(1, (SENDER,)))  # nobody left holding the weights: fatal


def test_abort_mode_interrupts_requests_itself_before_pausing():
    """SGLang's abort-mode pause re-checks only once a second; we abort, wait for the partial
    outputs to return, then pause a server with nothing left to abort."""
    in_flight = {"n": 3}

    class Server(Recorder):
        async def abort_all(self):
            await super().abort_all()
            in_flight["n"] = 0 if len([c for c in self.calls if c[0] == "abort"]) >= 2 else 1

    a = Server("a")
    orch, _ = orchestrator([a])
    asyncio.run(asyncio.wait_for(orch.pause(lambda: in_flight["n"]), 10))
    # one request arrived after the first abort and was aborted by the second
    # nothing of ours left running: no server pause (SGLang's abort pause can stall for a second)
    assert [c[0] for c in a.calls] == ["abort", "abort"]


def test_abort_mode_hands_stuck_requests_to_the_server_pause(monkeypatch):
    monkeypatch.setattr(weight_update, "_ABORT_BUDGET_S", 0.6)
    a = Recorder("a")
    orch, _ = orchestrator([a])
    asyncio.run(asyncio.wait_for(orch.pause(lambda: 1), 30))  # never returns to 0: bounded anyway
    # still running: SGLang's abort pause aborts what is left
    assert a.calls[-1] == ("pause", "abort") and a.calls.count(("abort",)) >= 2


def test_in_place_and_drain_modes_abort_nothing():
    a, b = Recorder("a"), Recorder("b")
    for mode, client in ((PauseMode.in_place, a), (PauseMode.drain, b)):
        pool = ServerPool()
        pool.add(0, client)
        asyncio.run(WeightUpdateOrchestrator(pool, mode, 5.0).pause(lambda: 0))
    assert a.calls == [("pause", "in_place")] and b.calls == []


def test_in_place_mode_keeps_the_cache():
    """SGLang refuses to flush while paused requests hold their KV (HTTP 400 ended the job)."""
    a = Recorder("a")
    pool = ServerPool()
    pool.add(0, a)
    orch = WeightUpdateOrchestrator(pool, PauseMode.in_place, 5.0)
    asyncio.run(orch.receive(2, (SENDER,)))
    assert [c[0] for c in a.calls] == ["begin", "bucket", "bucket", "end"]


def test_a_refused_flush_is_retried_until_the_scheduler_is_idle():
    from areal_jobs.rollout.sglang_client import ServerCallError

    class Busy(Recorder):
        async def flush_cache(self):
            await super().flush_cache()
            if self.calls.count(("flush",)) < 3:
                raise ServerCallError("0", "/flush_cache", "HTTP 400: Flush cache failed.", 400)

    a = Busy("a")
    orch, _ = orchestrator([a])
    asyncio.run(orch.receive(2, (SENDER,)))
    assert a.calls.count(("flush",)) == 3


def test_a_dead_server_found_by_the_abort_is_left_out_of_the_update():
    class Dead(Recorder):
        async def abort_all(self):
            raise ConnectionError("server gone")

    orch, pool = orchestrator([Recorder("a"), Dead("b")])
    asyncio.run(orch.pause(lambda: 0))
    assert pool.slots[0].up and not pool.slots[1].up


def test_only_a_known_server_that_is_down_and_not_joining_can_rejoin():
    pool = ServerPool()
    pool.add(0, object())
    pool.add(1, object())
    assert not pool.can_rejoin(0) and not pool.can_rejoin(7)  # up; unknown
    pool.mark_down(1, "health check failed")
    assert pool.can_rejoin(1)
    pool.rejoin(1, object())
    assert not pool.can_rejoin(1)  # joining until the next update promotes it
    assert pool.promote_joining() == [1] and not pool.can_rejoin(1)


class DiesAtBucket(Recorder):
    """kill -9 in the middle of the broadcast: its bucket call fails, its health check too."""

    async def update_weights_from_distributed(self, tensors, name, version, timeout_s=None):
        self.calls.append(("bucket", name, version, len(tensors)))
        raise ConnectionError("connection reset by peer")

    async def weight_version(self):
        raise ConnectionError("connection refused")


class Healthy(Recorder):
    async def update_weights_from_distributed(self, tensors, name, version, timeout_s=None):
        await asyncio.sleep(0.05)  # the survivor's calls return after the dead server's failed
        await super().update_weights_from_distributed(tensors, name, version)

    async def healthy(self):
        return False  # paused: SGLang's /health waits for a generation that cannot run now

    async def weight_version(self):
        return 0


def test_a_server_that_dies_mid_broadcast_fails_the_stage_once_the_others_returned():
    """The failure is raised only after every other server's pipeline ended: the groups are then
    safe to re-form without the dead server (nothing of the old broadcast is still running)."""
    orch, pool = orchestrator([Healthy("a"), DiesAtBucket("b")])
    with pytest.raises(StageError, match="weight broadcast bucket 1/2 of sender w to server 1"):
        asyncio.run(orch.receive(4, (SENDER,)))
    assert [c for c in pool.slots[0].client.calls if c[0] == "bucket"] == [
        ("bucket", "w-0", 4, 1),
        ("bucket", "w-0", 4, 1),
    ]
    # the survivor's update session is closed again: SGLang refuses a second begin while one is open
    assert pool.slots[0].client.calls[-1] == ("end",)


def test_find_lost_names_the_dead_and_those_already_marked_down():
    orch, pool = orchestrator([Healthy("a"), DiesAtBucket("b"), Healthy("c")])
    pool.mark_down(2, "health check failed")  # the health loop got there first
    assert asyncio.run(orch.find_lost([0, 1, 2])) == [1, 2]
    assert asyncio.run(orch.find_lost([0])) == []


class EncodedRecorder(Recorder):
    async def receive_encoded_bucket(self, tensors, name, version, timeout_s=None):
        await self._call("encoded", name, version, len(tensors))


def test_encoded_buckets_go_to_the_receiver_and_held_versions_follow_completed_updates():
    """weight_sync.sync=delta: the same stages, the encoded bucket call; a server holds a version
    only once every bucket of it arrived (what Paused.servers_version is computed from)."""
    a, b = EncodedRecorder("a"), EncodedRecorder("b", hang_on="encoded")
    orch, pool = orchestrator([a, b], timeout_s=0.2)
    encoded = WeightSender(SENDER.group_name, "127.0.0.1", 1, SENDER.buckets, encoded=True)
    assert [s.held_version for s in pool.up_slots] == [-1, -1]

    async def go():
        orch.next_generation()
        await orch.init_groups((encoded,), "gloo")
        with pytest.raises(StageError, match="weight broadcast bucket 1/2 of sender w to server 1"):
            await orch.receive(3, (encoded,))

    asyncio.run(go())
    assert [c for c in a.calls if c[0] in ("bucket", "encoded")] == [
        ("encoded", "w-1", 3, 1),
        ("encoded", "w-1", 3, 1),
    ]
    assert [s.held_version for s in pool.up_slots] == [-1, -1]  # the update broke off: nobody holds 3
    b.hang_on = None

    async def again():
        await orch.receive(4, (encoded,))

    asyncio.run(again())
    assert [s.held_version for s in pool.up_slots] == [4, 4]
    pool.mark_down(1, "test")
    pool.rejoin(1, b)
    pool.promote_joining()
    assert [s.held_version for s in pool.up_slots] == [4, -1]  # restarted: a full copy next
