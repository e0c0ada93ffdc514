"""Trainer rank 0's side of a server dying inside an update: its broadcast breaks off (the group is
dropped), the controller answers UpdateRetry, and the same version is asked for and sent again.
Scripted controller; the real one is in tests/integration/e2e/test_e2e_faults.py."""

from __future__ import annotations

import pytest
from test_trainer_inbox import ScriptedChannel  # the controller's replies, scripted

from areal_jobs.api import BucketSpec, TensorSpec, WeightSender
from areal_jobs.config import WeightSyncConfig
from areal_jobs.trainer.dist.ranks import Publish
from areal_jobs.trainer.intake.inbox import ControllerFailed, Inbox
from areal_jobs.trainer.publish import publisher as publisher_mod
from areal_jobs.trainer.publish.publisher import WeightPublisher
from areal_jobs.transport import messages as m
from areal_jobs.weights.broadcast import BroadcastTimeout
from areal_jobs.weights.phases import UpdatePhases

SENDER = WeightSender("s0", "127.0.0.1", 1, (BucketSpec(0, (TensorSpec("w", "float32", (4,)),)),))


class Ranks:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, cmd) -> None:
        self.sent.append(cmd)


class Stage:
    """The local sender: its first broadcast breaks off (a receiver died), later ones succeed."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.sent: list[m.Paused] = []
        self.dropped_group = False  # as StageSender: dropped after a broadcast broke off

    def send(self, paused: m.Paused) -> UpdatePhases:
        self.sent.append(paused)
        if self.failures:
            self.failures -= 1
            self.dropped_group = True
            raise BroadcastTimeout(
                "weight broadcast bucket 1/1 of s0 (version 3) failed: Connection closed by peer"
            )
        self.dropped_group = self.dropped_group and not paused.init_group
        return UpdatePhases(bytes_per_server=16.0)


def publisher(controller, stage):
    cfg = WeightSyncConfig(step_timeout_s=2.0)
    return WeightPublisher(cfg, Inbox(controller), Ranks(), stage, (SENDER,), disk_dir=None)


def test_a_broken_broadcast_is_sent_again_after_update_retry():
    first = m.Paused(version=3, world_size=3, init_group=True, group_generation=1)
    again = m.Paused(version=3, world_size=2, init_group=True, group_generation=2)
    controller = ScriptedChannel(
        first,
        m.UpdateRetry(3, (1,), "weight broadcast bucket 1/1 of sender s0 to server 1", "reset"),
        again,
        m.VersionPublished(version=3, update_s=0.5),
    )
    stage = Stage(failures=1)
    pub = publisher(controller, stage)
    metrics = pub.publish(3, backend=None, trained=("g1",))
    requests = [x for x in controller.sent if isinstance(x, m.PauseRequest)]
    assert [r.version for r in requests] == [3, 3] and requests[1].trained_group_ids == ("g1",)
    assert stage.sent == [first, again]
    assert pub.channel.sent == [Publish(first), Publish(again)]  # the other ranks join both tries
    assert metrics["weight_sync/retries"] == 1.0 and metrics["weight_sync/controller_s"] == 0.5


def test_update_failed_after_a_broken_broadcast_is_raised():
    controller = ScriptedChannel(
        m.Paused(version=3, world_size=2, init_group=False, group_generation=1),
        m.UpdateFailed(3, "weight broadcast bucket 1/1 of sender s0 to server 0", "HTTP 500"),
    )
    with pytest.raises(ControllerFailed, match="version 3 failed at weight broadcast"):
        publisher(controller, Stage(failures=1)).publish(3, backend=None, trained=())


def test_endless_retries_are_refused(monkeypatch):
    monkeypatch.setattr(publisher_mod, "MAX_UPDATE_RETRIES", 1)
    paused = m.Paused(version=3, world_size=2, init_group=True, group_generation=1)
    retry = m.UpdateRetry(3, (0,), "forming broadcast group s0-1 on server 0", "reset")
    controller = ScriptedChannel(paused, retry, paused, retry)
    with pytest.raises(RuntimeError, match="retried 1 times"):
        publisher(controller, Stage(failures=2)).publish(3, backend=None, trained=())


def test_a_broadcast_that_timed_out_on_the_trainer_but_reached_the_servers_regroups_next_time():
    """The trainer's half of the broadcast timed out (a starved machine) and it dropped its group,
    but the servers received every byte and the controller published the version. The next
    update asks for the groups to be formed again instead of reusing the dropped one."""
    controller = ScriptedChannel(
        m.Paused(version=3, world_size=2, init_group=True, group_generation=1),
        m.VersionPublished(version=3, update_s=9.0),
        m.Paused(version=4, world_size=2, init_group=True, group_generation=2),
        m.VersionPublished(version=4, update_s=0.5),
    )
    stage = Stage(failures=1)
    pub = publisher(controller, stage)
    pub.publish(3, backend=None, trained=())
    assert stage.dropped_group
    pub.publish(4, backend=None, trained=())
    requests = [x for x in controller.sent if isinstance(x, m.PauseRequest)]
    assert [(r.version, r.regroup) for r in requests] == [(3, False), (4, True)]
    assert not stage.dropped_group


def test_an_encoded_broadcast_is_vouched_for_or_disowned():
    """weight_sync.sync=delta: after its buckets the trainer tells the controller whether every
    collective completed (BroadcastDone), the only word the controller has with SGLang's loader."""
    encoded = WeightSender("s0", "127.0.0.1", 1, SENDER.buckets, encoded=True)
    first = m.Paused(version=3, world_size=3, init_group=True, group_generation=1)
    again = m.Paused(version=3, world_size=3, init_group=True, group_generation=2, timeout_scale=2.0)
    controller = ScriptedChannel(
        first, m.UpdateRetry(3, (), "the trainer's encoded broadcast of version 3", "broke off"),
        again, m.VersionPublished(version=3, update_s=0.5),
    )  # fmt: skip
    cfg = WeightSyncConfig(step_timeout_s=2.0)
    pub = WeightPublisher(cfg, Inbox(controller), Ranks(), Stage(failures=1), (encoded,), disk_dir=None)
    pub.publish(3, backend=None, trained=())
    words = [x for x in controller.sent if isinstance(x, m.BroadcastDone)]
    assert [(w.version, w.ok) for w in words] == [(3, False), (3, True)]
    assert "Connection closed by peer" in words[0].detail
