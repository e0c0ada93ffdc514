"""Trainer rank 0's mailbox: everything the controller sends, routed while the trainer waits.

Trajectory groups and control messages share one poll loop, so a group that arrives while the
trainer waits for `Paused` is buffered, never dropped. Every wait has a deadline that names what
was being waited for, and ends sooner when the controller falls silent: it sends stats every 2 s
while it lives, so a reply that is slow (a starved machine, a slow update) is waited for up to the
deadline, and a controller that stopped talking is given up on after `silence_s`
(control.peer_silence_s). `UpdateFailed` from the controller is raised as an error at once.
"""

from __future__ import annotations

import logging
import time
from typing import TypeVar

from areal_jobs.transport import messages as m
from areal_jobs.transport.channels import TrainerChannel

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ControllerFailed(RuntimeError):
    pass


class Inbox:
    def __init__(self, channel: TrainerChannel, silence_s: float = float("inf")) -> None:
        self.channel = channel
        self.silence_s = silence_s
        self.clock = time.monotonic  # (a test steps its own)
        self.last_heard = self.clock()  # when the controller last sent anything
        self.groups: list[m.TrajectoryGroup] = []  # arrival order
        self.rollout_stats: dict[str, float] = {}  # latest RolloutStats
        self.evals: list[m.EvalResult] = []  # not yet logged
        self.all_evals: list[m.EvalResult] = []
        self._control: list[m.ControlMessage] = []  # replies waited for, in arrival order
        self.weights_needed = False  # a server rejoined: publish the current weights again

    def send(self, msg: m.ControlMessage) -> None:
        self.channel.send(msg)

    def take_weights_needed(self) -> bool:
        """True once per WeightsNeeded: the caller publishes the current weights again."""
        needed, self.weights_needed = self.weights_needed, False
        return needed

    def take_groups(self) -> list[m.TrajectoryGroup]:
        """Every buffered group, in arrival order; the buffer is empty afterwards."""
        groups, self.groups = self.groups, []
        return groups

    def put_back(self, groups: list[m.TrajectoryGroup]) -> None:
        """Groups taken but not used go back to the front, ahead of any that arrived since."""
        self.groups[:0] = groups

    def take_evals(self) -> list[m.EvalResult]:
        """Evaluation results not yet logged."""
        evals, self.evals = self.evals, []
        return evals

    def pump(self, timeout_s: float) -> bool:
        """Receive at most one message (waiting up to timeout_s); True if one arrived."""
        msg = self.channel.poll(timeout_s)
        if msg is None:
            return False
        self.last_heard = self.clock()
        if isinstance(msg, m.TrajectoryGroup):
            self.groups.append(msg)
        elif isinstance(msg, m.RolloutStats):
            self.rollout_stats = dict(msg.metrics)
        elif isinstance(msg, m.EvalResult):
            self.evals.append(msg)
            self.all_evals.append(msg)
        elif isinstance(msg, m.WeightsNeeded):
            logger.info("controller asks for the current weights: %s", msg.reason)
            self.weights_needed = True
        elif isinstance(msg, m.UpdateFailed):
            raise ControllerFailed(
                f"weight update to version {msg.version} failed at {msg.stage}: {msg.error}"
            )
        else:
            self._control.append(msg)
        return True

    def wait_for(self, kind: type[T] | tuple[type, ...], timeout_s: float, waiting_for: str) -> T:
        """The first control message of `kind` (a type, or a tuple of types: whichever comes),
        within `timeout_s` (the deadline), unless the controller is silent for `silence_s` first."""
        start = self.clock()
        deadline = start + timeout_s
        while True:
            for i, msg in enumerate(self._control):
                if isinstance(msg, kind):
                    return self._control.pop(i)  # type: ignore[return-value]
            now = self.clock()
            silent_s = now - max(self.last_heard, start)
            if now >= deadline or silent_s >= self.silence_s:
                names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
                why = (
                    f"within {timeout_s:.0f}s"
                    if now >= deadline
                    else f"and nothing else either for {silent_s:.0f}s (control.peer_silence_s): is the controller alive? (logs/controller.log)"
                )
                raise TimeoutError(f"no {names} from the controller {why} while {waiting_for}")
            self.pump(min(deadline - now, self.silence_s - silent_s, 1.0))

    def wait_groups(self, count: int, timeout_s: float, interrupt=lambda: False) -> bool:
        """Block until at least `count` groups are buffered (True), or `interrupt()` holds (False)."""
        deadline = time.monotonic() + timeout_s
        while len(self.groups) < count:
            if interrupt():
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"only {len(self.groups)}/{count} trajectory groups after {timeout_s:.0f}s: is the rollout "
                    "side alive? (logs/controller.log; raise trainer.batch_wait_timeout_s if generation is slow)"
                )
            self.pump(min(remaining, 1.0))
        while self.pump(0):  # take everything already queued, so batch selection sees it
            pass
        return True
