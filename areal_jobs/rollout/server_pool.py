"""The set of rollout servers the controller dispatches to: load tracking and health.

Dispatch is least-loaded first (fewest in-flight requests, ties to the lowest index). A server
that fails a call or a health check is marked down. When it comes back (restarted by the
launcher, re-registered) it is *joining*: it takes no work until the next weight update has
formed the broadcast groups with it and given it the current weights (`promote_joining`). A
server added to the running job joins the same way (`admit`); one asked to leave is drained: no
new request, removed once its requests in flight have come back (`drain`, `remove`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from areal_jobs.api import RolloutEngineClient

logger = logging.getLogger(__name__)


class NoServerAvailable(RuntimeError):
    pass


@dataclass
class ServerSlot:
    index: int
    client: RolloutEngineClient
    tp_size: int = 1
    in_flight: int = 0
    up: bool = True
    joining: bool = False  # back from the dead (or new to the job); waits for the current weights
    draining: bool = False  # leaving the job: no new request; removed once none is in flight
    failures: int = 0
    completed: int = 0
    # the version whose weights it holds from a completed update (-1: new, restarted, or its last
    # update broke off); the sender sends a delta only onto a version every server holds
    held_version: int = -1


class ServerPool:
    def __init__(self, tp_size: int = 1) -> None:
        self.slots: dict[int, ServerSlot] = {}
        self.tp_size = tp_size  # of a server added to the running job

    def add(self, index: int, client: RolloutEngineClient, tp_size: int = 1) -> ServerSlot:
        slot = ServerSlot(index=index, client=client, tp_size=tp_size)
        self.slots[index] = slot
        return slot

    @property
    def up_slots(self) -> list[ServerSlot]:
        return [s for s in sorted(self.slots.values(), key=lambda s: s.index) if s.up]

    def least_loaded(self) -> ServerSlot:
        candidates = [s for s in self.up_slots if not s.draining]
        if not candidates:
            raise NoServerAvailable("no rollout server is up")
        return min(candidates, key=lambda s: (s.in_flight, s.index))

    def mark_down(self, index: int, why: str) -> None:
        slot = self.slots[index]
        if slot.up:
            logger.error("rollout server %d marked down: %s", index, why)
        slot.up = False
        slot.failures += 1

    def can_rejoin(self, index: int) -> bool:
        """A known server that is down and not already rejoining (a restarted process may take it)."""
        slot = self.slots.get(index)
        return slot is not None and not slot.up and not slot.joining

    def rejoin(self, index: int, client: RolloutEngineClient) -> None:
        """A restarted server (possibly at a new address) will get weights at the next update."""
        slot = self.slots[index]
        slot.client, slot.joining, slot.up, slot.in_flight = client, True, False, 0
        slot.held_version = -1

    def admit(self, index: int, client: RolloutEngineClient) -> None:
        """A server added to the running job (launch.scale): like a restarted one, it takes work
        only once the next update has given it the current weights."""
        slot = self.add(index, client, self.tp_size)
        slot.up, slot.joining = False, True

    def drain(self, index: int) -> None:
        """No new request goes to it; its requests in flight finish where they are."""
        self.slots[index].draining = True

    def remove(self, index: int) -> ServerSlot:
        """A drained server leaves the pool (the broadcast groups are re-formed without it)."""
        return self.slots.pop(index)

    @property
    def joining_slots(self) -> list[ServerSlot]:
        return [s for s in self.slots.values() if s.joining]

    def promote_joining(self) -> list[int]:
        """Called while generation is paused for an update: joiners are in it from here on."""
        promoted = [s.index for s in self.joining_slots]
        for index in promoted:
            self.slots[index].joining, self.slots[index].up = False, True
        return promoted

    @property
    def total_in_flight(self) -> int:
        return sum(s.in_flight for s in self.slots.values())

    def rank_offsets(self) -> dict[int, int]:
        """Broadcast-group rank of each up server's first TP rank (the sender is rank 0)."""
        offsets, next_rank = {}, 1
        for slot in self.up_slots:
            offsets[slot.index] = next_rank
            next_rank += slot.tp_size
        return offsets

    def group_world_size(self) -> int:
        return 1 + sum(s.tp_size for s in self.up_slots)
