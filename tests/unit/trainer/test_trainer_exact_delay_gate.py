"""algo.exact_delay = d, the trainer's publish gate (trainer/loop.py): before publishing the next
version it holds the next d batches, at every step, the last one included. A CI run once found
straddled segments at the end of an exact-delay run: the last step published without waiting, the
groups still generating met the final update and continued under the new weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from areal_jobs.config import AlgoConfig
from areal_jobs.trainer.loop import TrainLoop


class Holding:
    """An inbox holding `held` untrained groups; wait_groups records what it was asked for."""

    def __init__(self, held: int) -> None:
        self.groups = [object()] * held
        self.waits: list[tuple[int, float]] = []

    def wait_groups(self, count: int, timeout_s: float, interrupt=lambda: False) -> bool:
        self.waits.append((count, timeout_s))
        self.groups = [object()] * max(count, len(self.groups))
        return True


def gate(algo: AlgoConfig, held: int, step: int) -> list[tuple[int, float]]:
    loop = SimpleNamespace(algo=algo, inbox=Holding(held), step=step, batch_wait_timeout_s=30.0)
    TrainLoop._wait_for_next_batches(loop)
    return loop.inbox.waits


@pytest.mark.parametrize("step", [0, 1, 9, 10_000])  # the step just trained, 0-based: any, the last too
def test_the_gate_holds_d_batches_before_every_publish(step):
    algo = AlgoConfig(batch_size=2, exact_delay=2, max_staleness=2)
    assert gate(algo, held=3, step=step) == [(4, 30.0)]  # d * B = 4 untrained groups
    assert gate(algo, held=4, step=step) == []  # already held: publish at once


def test_no_gate_without_exact_delay_or_at_delay_0():
    assert gate(AlgoConfig(batch_size=2, max_staleness=2), held=0, step=3) == []
    assert gate(AlgoConfig(batch_size=2, exact_delay=0, max_staleness=0), held=0, step=3) == []
