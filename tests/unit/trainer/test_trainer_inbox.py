"""The trainer's inbox: what the train loop takes from it and gives back, through its methods.
The channel is a scripted stand-in (the real ZeroMQ channel is in tests/unit/transport and the
whole loop in tests/integration/e2e)."""

from __future__ import annotations

import numpy as np
import pytest

from areal_jobs.trainer.intake.inbox import Inbox
from areal_jobs.transport import messages as m


class ScriptedChannel:
    def __init__(self, *incoming) -> None:
        self.incoming = list(incoming)
        self.sent: list = []

    def poll(self, timeout_s: float):
        return self.incoming.pop(0) if self.incoming else None

    def send(self, msg) -> None:
        self.sent.append(msg)


def group(index: int) -> m.TrajectoryGroup:
    return m.TrajectoryGroup(f"g{index}", index, np.array([1], dtype=np.int32), ())


def test_groups_put_back_stay_ahead_of_groups_that_arrived_since():
    channel = ScriptedChannel(group(0), group(1), group(2))
    inbox = Inbox(channel)
    assert inbox.wait_groups(3, timeout_s=1.0)
    taken = inbox.take_groups()
    assert [g.data_index for g in taken] == [0, 1, 2] and inbox.groups == []
    channel.incoming.append(group(3))
    inbox.pump(0)
    inbox.put_back([taken[0], taken[2]])
    assert [g.data_index for g in inbox.groups] == [0, 2, 3]


def test_weights_needed_and_evals_are_taken_once():
    ev = m.EvalResult(2, 0.5, 0.5, 4, "periodic")
    inbox = Inbox(ScriptedChannel(m.WeightsNeeded(reason="server 1 rejoined"), ev))
    inbox.pump(0)
    inbox.pump(0)
    assert inbox.take_weights_needed() is True and inbox.take_weights_needed() is False
    assert inbox.take_evals() == [ev] and inbox.take_evals() == []
    assert inbox.all_evals == [ev]


def test_send_goes_to_the_controller():
    channel = ScriptedChannel()
    Inbox(channel).send(m.GroupsExpired(("g1r2",)))
    assert channel.sent == [m.GroupsExpired(("g1r2",))]


class TalkingController(ScriptedChannel):
    """Stats every 2 s (what a live controller sends) on a stepped clock; `reply` at `reply_at_s`,
    and nothing at all from `silent_from_s` on."""

    def __init__(self, reply=None, reply_at_s=1e9, silent_from_s=1e9) -> None:
        super().__init__()
        self.now, self.reply, self.reply_at_s, self.silent_from_s = 0.0, reply, reply_at_s, silent_from_s

    def poll(self, timeout_s: float):
        self.now += 2.0
        if self.reply is not None and self.now >= self.reply_at_s:
            reply, self.reply = self.reply, None
            return reply
        return m.RolloutStats(metrics={}) if self.now < self.silent_from_s else None


def test_a_slow_reply_is_waited_for_while_the_controller_keeps_talking():
    """A weight update on a starved machine: Paused after 500 s, far past the old 120 s timeout,
    while the controller's stats keep coming: waited for, up to the deadline."""
    paused = m.Paused(version=3, world_size=2, init_group=True, group_generation=1)
    channel = TalkingController(reply=paused, reply_at_s=500)
    inbox = Inbox(channel, silence_s=120)
    inbox.clock = lambda: channel.now
    assert inbox.wait_for(m.Paused, 1800, "pausing generation for version 3") == paused


def test_a_silent_controller_is_given_up_on_after_the_silence_bound():
    channel = TalkingController(silent_from_s=100)
    inbox = Inbox(channel, silence_s=120)
    inbox.clock = lambda: channel.now
    with pytest.raises(
        TimeoutError,
        match=r"no Paused from the controller and nothing else either for 12\ds \(control.peer_silence_s\)",
    ):
        inbox.wait_for(m.Paused, 1800, "pausing generation for version 3")
    assert 98 + 120 <= channel.now < 98 + 130  # the last stats came at 98 s


def test_the_deadline_ends_a_wait_even_while_the_controller_talks():
    channel = TalkingController()
    inbox = Inbox(channel, silence_s=120)
    inbox.clock = lambda: channel.now
    with pytest.raises(TimeoutError, match="no CheckpointSaved from the controller within 300s"):
        inbox.wait_for(m.CheckpointSaved, 300, "the controller saving checkpoint step 4")
