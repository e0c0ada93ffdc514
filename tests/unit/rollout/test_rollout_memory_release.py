"""The colocated schedule's memory hand-over (rollout/memory_release.py) against in-process fake
servers: the servers release their memory only once the batch of the current version is generated
and nothing is in flight, never while a request could reach them (the fake asserts it), and take
it back for the weight update; real servers: tests/integration/sglang and the colocated e2e run."""

from __future__ import annotations

import asyncio

from areal_jobs.config import PauseMode
from areal_jobs.rollout.memory_release import ServerMemory
from areal_jobs.rollout.weight_update import WeightUpdateOrchestrator

from .fake_server import FakeServer
from .test_rollout_controller_logic import make, until


def test_servers_release_once_the_batch_is_generated_and_wake_for_the_update():
    async def go():
        servers = [FakeServer("a", answer_len=lambda ids: 40), FakeServer("b", answer_len=lambda ids: 40)]
        ctl, pushed = make(servers, batch=2, eta=0)
        orch = WeightUpdateOrchestrator(ctl.pool, PauseMode.in_place, step_timeout_s=5.0)
        memory = ServerMemory(ctl, ctl.pool, orch, busy=lambda: False, enabled=True)
        tasks = [asyncio.create_task(ctl.admission_loop()), asyncio.create_task(memory.loop())]
        for version in range(3):
            # the batch of this version is in and nothing runs: every server gives its memory up
            await until(
                lambda v=version: all(s.memory_released for s in servers) and memory.releases == v + 1
            )
            assert len(pushed) == 2 * (version + 1) and ctl.pool.total_in_flight == 0
            assert memory.released and not ctl.running.is_set()
            # the trainer steps; then its update wakes the servers first
            assert await memory.wake() is True
            assert not any(s.memory_released for s in servers)
            ctl.on_version(version + 1)
            ctl.resume_sending()
        await until(lambda: len(pushed) == 8)
        await ctl.stop()
        for task in tasks:
            task.cancel()
        return servers, memory

    servers, memory = asyncio.run(go())
    assert memory.releases >= 3
    for server in servers:  # every release was answered by a resume, in order
        assert server.memory_calls[:6] == ["release", "resume"] * 3


def test_nothing_is_released_while_a_batch_is_still_generating_or_an_evaluation_runs():
    async def go():
        server = FakeServer("a", token_s=0.01, answer_len=lambda ids: 40)
        ctl, pushed = make([server], batch=2, eta=0)
        orch = WeightUpdateOrchestrator(ctl.pool, PauseMode.in_place, step_timeout_s=5.0)
        evaluating = [True]
        memory = ServerMemory(ctl, ctl.pool, orch, busy=lambda: evaluating[0], enabled=True)
        task = asyncio.create_task(ctl.admission_loop())
        await until(lambda: ctl.pool.total_in_flight > 0)
        assert not memory.idle()  # generating
        await until(lambda: len(pushed) == 2)
        await asyncio.sleep(0.05)
        assert not memory.idle()  # the batch is in, but an evaluation may still send requests
        evaluating[0] = False
        assert memory.idle()
        await memory.release()
        assert server.memory_released and await memory.wake() and not server.memory_released
        await ctl.stop()
        task.cancel()

    asyncio.run(go())


def test_an_asynchronous_run_never_releases_while_the_bound_admits_more():
    async def go():
        server = FakeServer("a", answer_len=lambda ids: 40)
        ctl, pushed = make([server], batch=2, eta=1)  # eta 1: two batches may be generated ahead
        orch = WeightUpdateOrchestrator(ctl.pool, PauseMode.in_place, step_timeout_s=5.0)
        memory = ServerMemory(ctl, ctl.pool, orch, busy=lambda: False, enabled=True)
        task = asyncio.create_task(ctl.admission_loop())
        idle_before_the_bound = []
        for _ in range(4000):  # bounded: 20 s
            if len(pushed) >= 4:
                break
            idle_before_the_bound.append(memory.idle())
            await asyncio.sleep(0.005)
        assert len(pushed) == 4 and not any(idle_before_the_bound)
        await until(memory.idle)  # only at the bound: nothing more to generate at this version
        await ctl.stop()
        task.cancel()

    asyncio.run(go())


def test_each_condition_of_idle_holds_the_release_back():
    """At the bound with nothing running, each of these alone keeps the servers' memory: a request
    still on a server (an evaluation's, a late abort), a group admitted and not yet pushed, a group
    waiting to be generated again, an update or evaluation under way."""

    async def go():
        server = FakeServer("a", answer_len=lambda ids: 40)
        ctl, pushed = make([server], batch=2, eta=0)
        orch = WeightUpdateOrchestrator(ctl.pool, PauseMode.in_place, step_timeout_s=5.0)
        busy = [False]
        memory = ServerMemory(ctl, ctl.pool, orch, busy=lambda: busy[0], enabled=True)
        task = asyncio.create_task(ctl.admission_loop())
        await until(lambda: len(pushed) == 2 and ctl.staleness.state.running == 0)
        await ctl.stop()
        task.cancel()
        assert memory.idle()
        slot = ctl.pool.slots[0]
        slot.in_flight += 1
        assert not memory.idle()
        slot.in_flight -= 1
        ctl.in_progress["g9"] = object()
        assert not memory.idle()
        del ctl.in_progress["g9"]
        ctl.requeued.append((9, 1))
        assert not memory.idle()
        ctl.requeued.clear()
        busy[0] = True
        assert not memory.idle()
        busy[0] = False
        assert memory.idle()

    asyncio.run(go())
