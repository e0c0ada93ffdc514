"""The controller's logic around a rollout server, against an in-process fake (unit tests):
interruption and continuation, failover with partial outputs, version stamps, snapshot/restore.
"""

from __future__ import annotations

import asyncio

from areal_jobs.config import AlgoConfig, DataConfig, RolloutConfig
from areal_jobs.data.prompts import Prompt, PromptStream
from areal_jobs.rollout.controller import RolloutController
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.rollout.snapshot import load_snapshot, save_snapshot

from .fake_server import FakeServer, ZeroScorer


class Stream(PromptStream):
    """Prompt i is [i+1, i+2, i+3]; answers are 40 - 3 = 37 tokens long."""

    def __init__(self):
        super().__init__(DataConfig(), encode=lambda text: [])

    def at(self, index: int) -> Prompt:
        return Prompt(index, [index + 1, index + 2, index + 3], "arith", "0")


def make(servers, *, batch=2, group=2, eta=1, max_new=64):
    pool = ServerPool()
    for i, s in enumerate(servers):
        pool.add(i, s)
    pushed = []

    async def push(g):
        pushed.append(g)

    ctl = RolloutController(
        RolloutConfig(max_new_tokens=max_new, max_concurrent=64),
        AlgoConfig(batch_size=batch, group_size=group, max_staleness=eta),
        pool, ZeroScorer(), Stream(), decode=lambda ids: "x", push=push,
    )  # fmt: skip
    return ctl, pushed


async def until(cond, timeout_s=20.0):
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError("condition not reached")


def expected_tokens(prompt_len=3, total=40):
    out = [100 + prompt_len + i for i in range(total - prompt_len)]
    out[-1] = 0
    return out


def test_groups_are_admitted_under_the_bound_and_pushed_complete():
    async def go():
        server = FakeServer("a", answer_len=lambda ids: 40)
        ctl, pushed = make([server], batch=2, eta=1)
        task = asyncio.create_task(ctl.admission_loop())
        await until(lambda: len(pushed) == 4)  # (eta + 1) * B at version 0
        await asyncio.sleep(0.2)
        assert len(pushed) == 4 and ctl.staleness.state.running == 0
        ctl.on_version(1)
        await until(lambda: len(pushed) == 6)
        await ctl.stop()
        task.cancel()
        return pushed

    pushed = asyncio.run(go())
    for g in pushed:
        assert len(g.samples) == 2
        for s in g.samples:
            assert s.output_ids.tolist() == expected_tokens() and s.finish_reason == "stop"
    assert [g.data_index for g in pushed] == list(range(6))


def test_interrupted_samples_continue_and_carry_both_versions():
    async def go():
        server = FakeServer("a", token_s=0.005, answer_len=lambda ids: 40)
        ctl, pushed = make([server], batch=1, group=2, eta=0)
        task = asyncio.create_task(ctl.admission_loop())
        await asyncio.sleep(0.06)  # some tokens generated
        ctl.running.clear()
        await server.pause("abort")
        server.weight_version = 1
        ctl.on_version(1)
        await server.resume()
        ctl.running.set()
        await until(lambda: len(pushed) >= 1)
        await ctl.stop()
        task.cancel()
        return pushed[0], server, ctl.counters

    group, server, counters = asyncio.run(go())
    for s in group.samples:
        versions = s.versions.tolist()
        assert (
            s.num_interruptions == 1
            and versions[0] == 0
            and versions[-1] == 1
            and versions == sorted(versions)
        )
        assert s.output_ids.tolist() == expected_tokens()  # continuation = prompt + partial output
    resent = [r for r in server.requests if len(r.input_ids) > 3]
    assert resent and all(r.max_new_tokens == 64 - (len(r.input_ids) - 3) for r in resent)
    # the re-prefill that abort costs is counted; the re-sent segments use version 1's cache namespace
    assert counters.resubmitted_segments == len(resent) == 2
    assert counters.reprefill_tokens == sum(len(r.input_ids) for r in resent)
    assert [r.cache_salt for r in server.requests[:2]] == ["v0", "v0"]
    assert {r.cache_salt for r in resent} == {"v1"}
    assert counters.straddled_segments == 0


def test_an_in_place_update_continues_requests_and_stamps_the_older_version():
    """pause_mode=in_place: the requests freeze and go on under version 1 without being re-sent;
    every token of the straddling segment carries version 0 (never fresher than its oldest)."""

    async def go():
        server = FakeServer("a", token_s=0.005, answer_len=lambda ids: 40)
        ctl, pushed = make([server], batch=1, group=2, eta=0)
        task = asyncio.create_task(ctl.admission_loop())
        await asyncio.sleep(0.06)  # some tokens generated
        ctl.running.clear()
        await server.pause("in_place")
        server.weight_version = 1
        ctl.on_version(1)
        await server.resume()
        ctl.running.set()
        await until(lambda: len(pushed) >= 2)  # eta = 0: the second group starts at version 1
        await ctl.stop()
        task.cancel()
        return pushed, server, ctl.counters

    pushed, server, counters = asyncio.run(go())
    for s in pushed[0].samples:
        assert s.num_interruptions == 0 and s.versions.tolist() == [0] * 37
        assert s.output_ids.tolist() == expected_tokens()
    assert counters.straddled_segments == 2 and counters.resubmitted_segments == 0
    assert counters.reprefill_tokens == 0
    # requests sent after the update never share cached prefixes with the old weights' requests
    assert [r.cache_salt for r in server.requests[:4]] == ["v0", "v0", "v1", "v1"]
    assert all(s.versions.tolist() == [1] * 37 for s in pushed[1].samples)


def test_a_dead_server_s_requests_move_to_the_other_with_their_partial_output():
    async def go():
        a, b = (
            FakeServer("a", token_s=0.004, answer_len=lambda ids: 40),
            FakeServer("b", token_s=0.004, answer_len=lambda ids: 40),
        )
        ctl, pushed = make([a, b], batch=2, group=2, eta=0)
        task = asyncio.create_task(ctl.admission_loop())
        await asyncio.sleep(0.05)
        a.dead = True
        await until(lambda: len(pushed) == 2)
        await ctl.stop()
        task.cancel()
        return ctl, pushed, b

    ctl, pushed, b = asyncio.run(go())
    assert not ctl.pool.slots[0].up and ctl.pool.slots[1].up
    assert ctl.counters.server_errors >= 1
    for g in pushed:
        for s in g.samples:
            assert s.output_ids.tolist() == expected_tokens()


def test_client_errors_fail_loudly_instead_of_failing_over():
    async def go():
        bad = FakeServer("a", status_on_fail=400)
        bad.dead = True
        ctl, _ = make([bad, FakeServer("b")], batch=1, group=2, eta=0)
        task = asyncio.create_task(ctl.admission_loop())
        await until(lambda: ctl.fatal is not None)
        await ctl.stop()
        task.cancel()
        return ctl

    ctl = asyncio.run(go())
    assert "400" in str(ctl.fatal) or "connection refused" in str(ctl.fatal)
    assert ctl.pool.slots[0].up  # a bad request is not the server's fault


def test_snapshot_restore_continues_partial_samples_from_saved_tokens(tmp_path):
    lengths = lambda ids: 20 + 15 * ids[0]  # noqa: E731 - prompt i answers with 17 + 15 (i + 1) tokens

    def expected(index):
        return expected_tokens(total=lengths([index + 1]))

    async def first():
        server = FakeServer("a", token_s=0.004, answer_len=lengths)
        ctl, pushed = make([server], batch=2, group=2, eta=1, max_new=200)
        task = asyncio.create_task(ctl.admission_loop())
        await until(lambda: len(pushed) >= 1)
        ctl.running.clear()
        await server.pause("abort")
        await asyncio.sleep(0.1)  # the aborted calls return; partial outputs land in the sample states
        snap = ctl.snapshot(step=0)
        await ctl.stop()
        task.cancel()
        return snap, pushed

    snap, pushed_before = asyncio.run(first())
    save_snapshot(snap, tmp_path)
    loaded = load_snapshot(tmp_path)
    assert loaded.stream_position == snap.stream_position == 4
    assert [g.group_id for g in loaded.retained] == [g.group_id for g in snap.retained]
    partial = {g.data_index: [list(s.output_ids) for s in g.samples] for g in loaded.partial}
    assert any(0 < len(t) < len(expected(i)) for i, ts in partial.items() for t in ts)

    async def second():
        server = FakeServer("a", answer_len=lengths)
        ctl, pushed = make([server], batch=2, group=2, eta=1, max_new=200)
        resent = ctl.restore(loaded)
        task = asyncio.create_task(ctl.admission_loop())
        await until(lambda: {g.data_index for g in pushed} >= set(partial))
        await ctl.stop()
        task.cancel()
        return resent, pushed, server

    resent, pushed, server = asyncio.run(second())
    assert [g.group_id for g in resent] == [g.group_id for g in loaded.retained]
    for g in pushed:
        for s in g.samples:
            assert s.output_ids.tolist() == expected(g.data_index)
    # a continuing sample is re-sent as prompt + its saved tokens, not from scratch
    for index, outputs in partial.items():
        for tokens in outputs:
            if tokens:
                assert any(r.input_ids == [index + 1, index + 2, index + 3] + tokens for r in server.requests)
    # every admitted prompt is accounted for: pushed before, saved whole, or continued
    accounted = {g.data_index for g in pushed_before} | {g.data_index for g in loaded.retained} | set(partial)
    assert accounted == set(range(loaded.stream_position))


def test_an_expired_group_is_generated_again_as_its_next_attempt():
    """Identity is typed: the regenerated group's attempt is the expired group's + 1, read from the
    group itself (its id is only a key; nothing parses it)."""

    async def go():
        server = FakeServer("a", answer_len=lambda ids: 10)
        ctl, pushed = make([server], batch=1, group=2, eta=0)
        task = asyncio.create_task(ctl.admission_loop())
        await until(lambda: len(pushed) == 1)
        first = pushed[0]
        ctl.on_expired((first.group_id,))
        await until(lambda: len(pushed) == 2)
        ctl.on_expired((pushed[1].group_id,))
        await until(lambda: len(pushed) == 3)
        await ctl.stop()
        task.cancel()
        return pushed

    pushed = asyncio.run(go())
    assert [(g.data_index, g.attempt) for g in pushed] == [(0, 0), (0, 1), (0, 2)]
    assert len({g.group_id for g in pushed}) == 3


def _train_until_long_group_done(ctl, server, pushed, eta, max_steps=40):
    """A trainer stand-in: oldest group first, B = 1, the trainer's freshness check; returns the
    (data_index, staleness) trained and the data indices expired, until prompt 0 (the long
    answer) is trained or expired."""

    async def go():
        task = asyncio.create_task(ctl.admission_loop())
        version, taken, trained, expired = 0, 0, [], []
        for _ in range(max_steps):
            await until(lambda n=taken: len(pushed) > n)
            group = min(pushed[taken:], key=lambda g: g.oldest_version)
            pushed.remove(group)
            pushed.insert(taken, group)
            taken += 1
            if version - group.oldest_version > eta:
                expired.append(group.data_index)
                ctl.on_expired((group.group_id,))
            else:
                trained.append((group.data_index, version - group.oldest_version))
                ctl.on_trained((group.group_id,), version + 1)
                version += 1
                server.weight_version = version
                ctl.on_version(version)
            if group.data_index == 0:
                break
        await ctl.stop()
        task.cancel()
        return trained, expired

    return asyncio.run(go())


def test_a_long_answer_is_not_overtaken_until_it_expires():
    """Prompt 0's answer is 25x longer than the others. Short groups finished after it started
    are held back (may_push) so the trainer cannot step past the long group's deadline: it is
    trained within eta, never expired and generated again."""
    server = FakeServer("a", answer_len=lambda ids: 300 if ids[0] == 1 else 12)
    ctl, pushed = make([server], batch=1, group=2, eta=1, max_new=400)
    trained, expired = _train_until_long_group_done(ctl, server, pushed, eta=1)
    assert expired == []
    assert (0, 1) in trained or (0, 0) in trained
    assert all(staleness <= 1 for _, staleness in trained)
    assert ctl.counters.held_groups >= 1


def test_without_the_hold_the_long_answer_expires(monkeypatch):
    """The control: the same run with every group pushed at once expires the long answer."""
    import areal_jobs.rollout.controller as controller

    monkeypatch.setattr(controller, "may_push", lambda *args: True)
    server = FakeServer("a", answer_len=lambda ids: 300 if ids[0] == 1 else 12)
    ctl, pushed = make([server], batch=1, group=2, eta=1, max_new=400)
    trained, expired = _train_until_long_group_done(ctl, server, pushed, eta=1)
    assert expired == [0]
