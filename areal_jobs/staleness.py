"""Admission control under the staleness bound eta (AReaL section 5.1).

Counting unit: prompt groups. With B groups per training step, the trainer's published policy
version v, and a = groups accepted (ever) + groups running, a new group may start only while

    a < (eta + v + 1) * B        and        running < max_running

so no more than (eta + 1) batches of data can be generated ahead of the trainer. eta = 0 makes
generation synchronous: B groups per version, and the trainer waits for all of them.

Worked example, eta = 1, B = 2: at v = 0 four groups may be admitted; the trainer consumes two
(v -> 1), and two more become admissible. A group that is dropped (filtered, or expired and
re-queued) gives its slot back through `on_rejected`.

The bound on admission is not enough alone: a long answer admitted early can finish after
faster, later ones were trained. `may_push` keeps room for it: the controller holds a finished
group back while handing it over would let the trainer fill every batch up to an in-flight
group's deadline (its oldest token's version + eta) without that group (earliest deadline first;
the group with the earliest deadline always goes, so the hold ends). Without it, a long answer
expired at the trainer (`is_fresh`, the last check, applied when a batch is built) and was
generated again: measured, 103 of 900 groups in `make run` (11% of the generation wasted, and
the longest answers trained least).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class StalenessState:
    accepted: int = 0  # groups finished and handed to the trainer, over the whole run
    running: int = 0  # groups admitted and not finished
    rejected: int = 0  # groups dropped after admission (filtered or expired)


class StalenessManager:
    """Thread-safe counters plus the admission rule. Pure: no I/O, no clocks."""

    def __init__(self, batch_size: int, max_staleness: int, max_running: int) -> None:
        if batch_size < 1 or max_staleness < 0 or max_running < 1:
            raise ValueError("batch_size >= 1, max_staleness >= 0 and max_running >= 1 are required")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.max_running = max_running
        self._state = StalenessState()
        self._lock = threading.Lock()

    def capacity(self, version: int) -> int:
        """How many more groups may be admitted now at trainer version `version`."""
        with self._lock:
            s = self._state
            by_staleness = (self.max_staleness + version + 1) * self.batch_size - (s.accepted + s.running)
            by_concurrency = self.max_running - s.running
            return max(0, min(by_staleness, by_concurrency))

    def try_admit(self, version: int) -> bool:
        """Admit one group if the bound allows it (atomic check-and-increment)."""
        with self._lock:
            s = self._state
            if s.accepted + s.running >= (self.max_staleness + version + 1) * self.batch_size:
                return False
            if s.running >= self.max_running:
                return False
            s.running += 1
            return True

    def set_bound(self, max_staleness: int) -> None:
        """algo.max_staleness=auto: the bound in force from now on (areal_jobs/staleness_bound.py).
        Groups already admitted keep their slots: a lower bound only holds admission back until
        the trainer has consumed the surplus (the backlog drains, nothing is dropped)."""
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        with self._lock:
            self.max_staleness = max_staleness

    def on_accepted(self) -> None:
        with self._lock:
            self._require_running()
            self._state.running -= 1
            self._state.accepted += 1

    def on_rejected(self) -> None:
        """A running group was dropped before reaching the trainer: free its slot."""
        with self._lock:
            self._require_running()
            self._state.running -= 1
            self._state.rejected += 1

    def on_expired(self) -> None:
        """An accepted group was too stale to train; it will be regenerated: free its slot."""
        with self._lock:
            if self._state.accepted < 1:
                raise RuntimeError("on_expired without an accepted group")
            self._state.accepted -= 1
            self._state.rejected += 1

    def _require_running(self) -> None:
        if self._state.running < 1:
            raise RuntimeError("staleness counters out of sync: no running group to finish")

    @property
    def state(self) -> StalenessState:
        with self._lock:
            return StalenessState(**vars(self._state))

    def state_dict(self) -> dict[str, int]:
        """For checkpoints. Running groups are saved with the controller's partial rollouts."""
        with self._lock:
            return dict(vars(self._state))

    def load_state_dict(self, state: dict[str, int]) -> None:
        with self._lock:
            self._state = StalenessState(**{k: int(state[k]) for k in ("accepted", "running", "rejected")})


def is_fresh(oldest_version: int, trainer_version: int, max_staleness: int) -> bool:
    """True when a sample whose oldest token is `oldest_version` may train at `trainer_version`.

    The trainer at version v produces v + 1 from this batch; a token sampled under version u is
    v - u versions old. eta = 0 demands every token come from v itself.
    """
    return trainer_version - oldest_version <= max_staleness


def exact_delay_target(trainer_version: int, delay: int) -> int:
    """algo.exact_delay = d: the policy version whose samples the trainer at `trainer_version`
    trains: v - d, and version 0's during the first d versions (nothing older exists: the ramp,
    staleness 0, 1, ..., d - 1)."""
    return max(0, trainer_version - delay)


def exact_delay_batch(
    oldest_versions: list[int], trainer_version: int, delay: int, batch_size: int
) -> list[int] | None:
    """Indices of the groups (by their oldest token's version) the trainer takes under
    algo.exact_delay = d, oldest first; None while fewer than B groups are old enough.

    Why this is exactly d old (worked in docs/protocols.md, "Exact delay"): admission allows
    (d + v + 1) * B groups in all by version v, and the trainer publishes v + 1 only once it holds
    d * B untrained groups (`exact_delay_may_publish`), so every group admitted under version v
    was generated, start to end, under version v (nothing is in flight at an update), and the
    version-v batch is B groups. The trainer at v + d has trained (v + d) * B groups, all of the
    (d + v) * B groups older than v among them: the B groups with oldest version <= v - which this
    selects - are exactly version v's.
    """
    target = exact_delay_target(trainer_version, delay)
    order = sorted(range(len(oldest_versions)), key=lambda i: (oldest_versions[i], i))
    eligible = [i for i in order if oldest_versions[i] <= target]
    return eligible[:batch_size] if len(eligible) >= batch_size else None


def exact_delay_may_publish(untrained_groups: int, delay: int, batch_size: int) -> bool:
    """algo.exact_delay = d: may the trainer publish its next version? Only once it holds the next
    d batches (d * B untrained groups): then every group admitted under the current version has
    been delivered, none is in flight, and no sample straddles the update."""
    return untrained_groups >= delay * batch_size


def may_push(
    deadline: int, version: int, unacked: int, in_flight_deadlines: Iterable[int], batch_size: int
) -> bool:
    """May a finished group whose deadline is `deadline` go to the trainer now?

    Deadline: the last trainer version that may train a group (oldest token's version + eta).
    The trainer is at `version` and holds `unacked` groups not yet trained (its current batch
    included); it takes B groups per version, oldest first. Pushing must leave, for every in-flight
    group (admitted, not pushed) with an earlier deadline d >= version, a slot in the batches
    version..d: unacked + 1 + #(in flight with deadline <= d) <= (d - version + 1) * B.
    In-flight groups already past their deadline cannot be saved and are not waited for.

    Worked example, B = 2, version 5: a long answer in flight with deadline 6 (batches 5 and 6
    hold 4 groups); with 2 groups unacked, one more group (deadline 9) may go (2 + 1 + 1 <= 4),
    a second one must wait (3 + 1 + 1 > 4) until the long answer is pushed or a version passes.
    """
    earlier = sorted(d for d in in_flight_deadlines if version <= d < deadline)
    for count, d in enumerate(earlier, start=1):
        if unacked + 1 + count > (d - version + 1) * batch_size:
            return False
    return True
