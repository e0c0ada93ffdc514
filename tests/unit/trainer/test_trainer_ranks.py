"""Rank 0 -> follower commands (trainer/dist/ranks.py) on a real gloo group of 2 processes.

Each scenario runs in 2 fresh `spawn` processes; a rank that hangs is killed at a hard deadline,
so a broken protocol fails the test instead of hanging it. Workers leave with os._exit: a
collective left pending on purpose (the timeout scenario) must not block their exit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import threading
import time
import traceback

from areal_jobs.api import BucketSpec, TensorSpec, WeightSender
from areal_jobs.trainer.dist import ranks
from areal_jobs.transport import messages as m

PAUSED = m.Paused(version=3, world_size=2, init_group=True, group_generation=7)
SENDER = WeightSender(
    "areal-weights-s1", "127.0.0.1", 29701, (BucketSpec(0, (TensorSpec("w", "float32", (2, 3)),)),)
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(scenario: str, rank: int, port: int, tmp: str, results) -> None:
    import datetime

    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip
        results.put((rank, "ok", SCENARIOS[scenario](rank, tmp)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(0)


def run_pair(scenario: str, tmp: str = "", expect: tuple[int, ...] = (0, 1), timeout_s: float = 90.0) -> dict:
    """Run `scenario` on ranks 0 and 1; the results of the ranks in `expect`."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(scenario, r, port, tmp, results)) for r in range(2)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < len(expect):
            try:
                rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"{scenario}: ranks {sorted(set(expect) - set(out))} gave no result"
                ) from None
            assert status == "ok", f"{scenario} failed on rank {rank}:\n{value}"
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return out


class FakeBackend:
    """Records every call; train_step returns what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def train_step(self, batch):
        self.calls.append(("train_step", batch))
        return {"train/loss": 1.0}

    def weight_specs(self):
        return []

    def iter_weights(self):
        return iter(())

    def save_checkpoint(self, path):
        self.calls.append(("save_checkpoint", path))

    def load_checkpoint(self, path):
        self.calls.append(("load_checkpoint", path))

    def save_hf(self, path):
        self.calls.append(("save_hf", path))


class FakeStage:
    def __init__(self) -> None:
        self.sent: list[m.Paused] = []
        self.closed = False

    def send(self, paused):
        self.sent.append(paused)
        return 0.0

    def close(self):
        self.closed = True


# ------------------------------------------------------------------------------ scenarios


def _every_command(rank: int, tmp: str):
    """Rank 0 drives a LeaderBackend through a whole run; rank 1 follows."""
    channel = ranks.RankChannel.join(command_timeout_s=30.0)
    backend, stage = FakeBackend(), FakeStage()
    if rank == 0:
        leader = ranks.LeaderBackend(backend, channel)
        leader.load_checkpoint("/ckpt/step_000002/trainer")
        metrics = leader.train_step("the batch")
        channel.send(ranks.Publish(PAUSED))
        leader.save_checkpoint("/ckpt/step_000004/trainer")
        leader.save_hf("/run/final_hf")
        channel.send(ranks.Stop())
        return {"calls": backend.calls, "metrics": metrics}
    signalled = threading.Event()
    signalled.set()  # a forwarded SIGUSR1: noted, not acted on
    ranks.follow(channel, backend, stage, signalled)
    return {
        "calls": backend.calls,
        "sent": stage.sent,
        "closed": stage.closed,
        "signalled": signalled.is_set(),
    }


def _gather(rank: int, tmp: str):
    channel = ranks.RankChannel.join(command_timeout_s=30.0)
    from areal_jobs.trainer.publish.publisher import gather_senders
    from areal_jobs.weights.sender import StageSender

    first = WeightSender("areal-weights-s0", "127.0.0.1", 29700, SENDER.buckets)
    senders = gather_senders(channel, StageSender(None, first if rank == 0 else SENDER, None))
    try:  # rank 0 not a sender: refused on every rank, not just on rank 0
        gather_senders(channel, StageSender(None, None if rank == 0 else SENDER, None))
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    return {"senders": senders, "refused": refused}


def _abort(rank: int, tmp: str):
    channel = ranks.RankChannel.join(command_timeout_s=30.0)
    if rank == 0:
        channel.abort("ValueError: the batch was bad")
        return "announced"
    try:
        ranks.follow(channel, FakeBackend(), FakeStage(), threading.Event())
    except ranks.RankAborted as exc:
        return str(exc)
    return "followed to the end"


def _silent_leader(rank: int, tmp: str):
    """Rank 0 stays alive and silent until rank 1 has given up (it leaves a marker file)."""
    from pathlib import Path

    marker = Path(tmp, "gave-up")
    channel = ranks.RankChannel.join(command_timeout_s=2.0)
    if rank == 0:
        for _ in range(600):
            if marker.exists():
                return "alive when rank 1 gave up"
            time.sleep(0.1)
        return "rank 1 never gave up"
    try:
        channel.receive()
    except ranks.RankAborted as exc:
        marker.write_text(str(exc))
        return str(exc)
    return "received a command nobody sent"


def _leader_dies(rank: int, tmp: str):
    channel = ranks.RankChannel.join(command_timeout_s=60.0)
    joined = os.path.join(tmp, "rank1-joined")
    if rank == 0:
        # Die only once rank 1 has left join(): join ends with rank 1 reading the group's sequence
        # number from the TCP store that rank 0 hosts, and rank 0 does not wait for that, so dying
        # at once can hit rank 1 still in join ("Connection reset by peer" under load; now
        # RankAborted "joining rank 0's command group"), which is not the case this test is about
        while not os.path.exists(joined):
            time.sleep(0.01)
        os._exit(1)  # a crash: no Abort, no Stop
    open(joined, "w").close()
    try:
        channel.receive()
    except ranks.RankAborted as exc:
        return str(exc)
    return "received a command nobody sent"


def _leader_dies_in_join(rank: int, tmp: str):
    if rank == 1:
        os.nice(19)  # the loaded machine: rank 1 is often still in join when rank 0 is gone
    try:
        channel = ranks.RankChannel.join(command_timeout_s=60.0)
        if rank == 0:
            os._exit(1)
        channel.receive()
    except ranks.RankAborted as exc:
        return str(exc)
    return "received a command nobody sent"


SCENARIOS = {
    "every_command": _every_command,
    "gather": _gather,
    "abort": _abort,
    "silent_leader": _silent_leader,
    "leader_dies": _leader_dies,
    "leader_dies_in_join": _leader_dies_in_join,
}


# ------------------------------------------------------------------------------ tests


def test_commands_round_trip_through_json():
    for cmd in (
        ranks.Train(),
        ranks.Publish(PAUSED),
        ranks.SaveCheckpoint("/a/b"),
        ranks.LoadCheckpoint("/c"),
        ranks.SaveHF("/d"),
        ranks.Stop(),
        ranks.Abort("boom"),
    ):
        assert ranks.decode(ranks.encode(cmd)) == cmd


def test_one_rank_sends_nothing_and_gathers_itself():
    channel = ranks.RankChannel.single()
    backend = FakeBackend()
    leader = ranks.LeaderBackend(backend, channel)
    leader.train_step("b")
    leader.save_hf("/x")
    channel.abort("nothing to tell")
    assert backend.calls == [("train_step", "b"), ("save_hf", "/x")]
    assert channel.all_gather_json({"a": 1}) == [{"a": 1}]


def test_followers_make_every_collective_call_rank_0_announces():
    out = run_pair("every_command")
    leader, follower = out[0], out[1]
    assert leader["metrics"] == {"train/loss": 1.0}
    assert leader["calls"] == [
        ("load_checkpoint", "/ckpt/step_000002/trainer"),
        ("train_step", "the batch"),
        ("save_checkpoint", "/ckpt/step_000004/trainer"),
        ("save_hf", "/run/final_hf"),
    ]
    # the same calls in the same order; the batch comes from rank 0 inside the backend
    assert follower["calls"] == [
        ("load_checkpoint", "/ckpt/step_000002/trainer"),
        ("train_step", None),
        ("save_checkpoint", "/ckpt/step_000004/trainer"),
        ("save_hf", "/run/final_hf"),
    ]
    assert follower["sent"] == [PAUSED] and follower["closed"] is True
    assert follower["signalled"] is False  # noted and cleared; Stop still ended it normally


def test_rank_0_gathers_every_stage_sender_in_stage_order():
    out = run_pair("gather")
    for rank in (0, 1):
        senders = out[rank]["senders"]
        assert [s.group_name for s in senders] == ["areal-weights-s0", "areal-weights-s1"]
        assert senders[1] == SENDER
        assert "rank 0 exports no weights" in out[rank]["refused"]


def test_a_failing_rank_0_makes_the_follower_fail_with_its_reason():
    out = run_pair("abort")
    assert out[0] == "announced"
    assert "rank 0 failed: ValueError: the batch was bad" in out[1]


def test_a_follower_gives_up_when_rank_0_stays_silent(tmp_path):
    out = run_pair("silent_leader", str(tmp_path))
    assert out[0] == "alive when rank 1 gave up"
    assert "rank 1 waiting for rank 0's next command" in out[1]


def test_a_follower_fails_at_once_when_rank_0_dies(tmp_path):
    out = run_pair("leader_dies", str(tmp_path), expect=(1,))
    assert "rank 1 waiting for rank 0's next command" in out[1]


def test_a_follower_fails_at_once_when_rank_0_dies_while_it_joins():
    """Rank 0 leaves join() before a slow follower has read the group's sequence number from the
    store rank 0 hosts: wherever rank 1 is when rank 0 dies, it gets RankAborted (not a raw
    "Connection reset by peer" from the store)."""
    out = run_pair("leader_dies_in_join", expect=(1,))
    assert "rank 1 joining rank 0's command group" in out[1] or "rank 1 waiting for rank 0" in out[1]
