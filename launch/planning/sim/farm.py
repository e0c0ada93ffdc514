"""Rollout servers under continuous batching, modelled as processor sharing.

A server with b active sequences decodes `tp * f(b)` tokens/s (f: `RolloutSpeed`), shared equally,
so each active sequence advances at `tp * f(b) / b` tokens/s. Instead of stepping tokens, every
server keeps one "work" clock: the tokens each of its active sequences has generated since the
clock started. A sequence that joins at work W with L tokens to go finishes when work reaches W + L,
so its finish is a heap key that never changes; only the clock's speed changes when b changes.
One event per finished sequence, whatever the lengths: 10^5 sequences simulate in about a second.

Requests go to the least-loaded server (fewest in flight, ties to the lowest index), as
`ServerPool.least_loaded` does; past `max_batch` they wait in the server's FIFO queue.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from launch.planning.sim.profile import RolloutSpeed

_EPS_TOKENS = 1e-6


class ServerFarm:
    def __init__(self, num_servers: int, speed: RolloutSpeed, tp: int = 1) -> None:
        if num_servers < 1:
            raise ValueError("the simulated cluster has no rollout server: raise cluster.rollout_fraction")
        self.num_servers = num_servers
        self.max_batch = speed.max_batch_per_gpu * tp
        # per-sequence tokens/s at each batch size, precomputed once
        self._rate = [0.0] + [tp * speed.gpu_tokens_per_s(b / tp) / b for b in range(1, self.max_batch + 1)]
        n = num_servers
        self.work = [0.0] * n  # per-sequence tokens generated since the clock started, at t_ref
        self.t_ref = [0.0] * n
        self.rate = [0.0] * n  # per-sequence tokens/s now
        self.active: list[list[tuple[float, int]]] = [[] for _ in range(n)]  # heaps of (finish work, seq)
        self.queued: list[deque[tuple[int, int]]] = [deque() for _ in range(n)]  # (seq, tokens)
        self.load = [0] * n  # requests in flight (active + queued), what least-loaded dispatch sees
        self._stamp = [0] * n  # invalidates a server's older completion events
        self._events: list[tuple[float, int, int]] = []  # (time, server, stamp)
        self._by_load = [(0, i) for i in range(n)]  # lazy heap of (load, server)
        self.paused = False
        self.busy_server_s = 0.0  # integral of "server has work and is not paused" over time

    # ------------------------------------------------------------------ requests

    def submit(self, t: float, seq: int, tokens: int) -> None:
        s = self._least_loaded()
        self._advance(s, t)
        if len(self.active[s]) < self.max_batch:
            heapq.heappush(self.active[s], (self.work[s] + tokens, seq))
        else:
            self.queued[s].append((seq, tokens))
        self.load[s] += 1
        heapq.heappush(self._by_load, (self.load[s], s))
        self._reschedule(s, t)

    def next_time(self) -> float:
        ev = self._events
        while ev and ev[0][2] != self._stamp[ev[0][1]]:
            heapq.heappop(ev)
        return ev[0][0] if ev else math.inf

    def pop_finished(self, t: float) -> list[int]:
        """Advance the server whose event is due at `t`; return the sequences that finished."""
        _, s, _ = heapq.heappop(self._events)
        self._advance(s, t)
        heap, done = self.active[s], []
        while heap and heap[0][0] <= self.work[s] + _EPS_TOKENS:
            done.append(heapq.heappop(heap)[1])
        while self.queued[s] and len(heap) < self.max_batch:
            seq, tokens = self.queued[s].popleft()
            heapq.heappush(heap, (self.work[s] + tokens, seq))
        self.load[s] -= len(done)
        heapq.heappush(self._by_load, (self.load[s], s))
        self._reschedule(s, t)
        return done

    # ------------------------------------------------------------------ weight updates

    def pause(self, t: float) -> None:
        for s in range(self.num_servers):
            self._advance(s, t)
            self._stamp[s] += 1
        self.paused = True

    def resume(self, t: float) -> None:
        self.paused = False
        for s in range(self.num_servers):
            self.t_ref[s] = t
            self._reschedule(s, t)

    @property
    def in_flight(self) -> int:
        return sum(self.load)

    # ------------------------------------------------------------------ internals

    def _least_loaded(self) -> int:
        heap = self._by_load
        while heap[0][0] != self.load[heap[0][1]]:
            heapq.heappop(heap)
        return heap[0][1]

    def _advance(self, s: int, t: float) -> None:
        dt = t - self.t_ref[s]
        if dt > 0 and not self.paused:
            self.work[s] += self.rate[s] * dt
            if self.active[s]:
                self.busy_server_s += dt
        self.t_ref[s] = t

    def _reschedule(self, s: int, t: float) -> None:
        heap = self.active[s]
        self.rate[s] = self._rate[len(heap)]
        self._stamp[s] += 1
        if heap and not self.paused:
            finish_t = t + max(0.0, heap[0][0] - self.work[s]) / self.rate[s]
            heapq.heappush(self._events, (finish_t, s, self._stamp[s]))
