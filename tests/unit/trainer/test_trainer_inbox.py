"""The trainer's inbox: what the train loop takes from it and gives back, through its methods.
The channel is a scripted stand-in (the real ZeroMQ channel is in tests/unit/transport and the
whole loop in tests/integration/e2e)."""

from __future__ import annotations

import numpy as np

from areal_jobs.trainer.inbox import Inbox
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
