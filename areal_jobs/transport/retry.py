"""Repeating what is safe to repeat: exponential backoff with jitter under one deadline per call.

A shared cluster is slow in bursts (a login node under load, a stalled file system, a neighbour
eating a node's CPUs). A control call that times out once is then not a failure of the run, only
of that attempt. Calls that are safe to repeat (`Repeat.safe`, or `Repeat.by_state`: a repeat is
answered with the state the first attempt already reached) are repeated until their deadline;
each attempt waits longer than the last (its timeout doubles, as TCP's retransmission timer), the
pauses between attempts grow exponentially with full jitter (so many callers do not retry in
step), and the deadline is never shorter than `DEADLINE_ROUND_TRIPS` round trips of the same call
as this process has recently measured them: it grows with how slow the machine is now. A call
whose late twin could do harm (a state change that a later call undoes) is never sent twice while
its first attempt may still be pending: `wait_patiently` waits for that one request instead, up to
the same deadline. Calls that are not safe to repeat alone (`Repeat.once`) are never repeated here;
the operation around them is, under its own identity (a weight update by its version, a
generation by its request id).

Pure logic: no I/O of its own (the clock, the sleep and the random source are parameters).
The table of every control call of the job is docs/faults.md ("Control calls").
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# the deadline is at least this many round trips of the same call, as recently measured
DEADLINE_ROUND_TRIPS = 20.0


@dataclass(frozen=True)
class RetryPolicy:
    """How one kind of call is repeated. Attempt n (1, 2, ...) gets `first_timeout_s * 2**(n-1)`
    (at most `max_timeout_s`), and after a failure the caller pauses a uniform random time in
    [0, min(max_backoff_s, backoff_s * 2**(n-1))] before attempt n + 1. No attempt starts after
    `deadline_s` (counted from the first attempt)."""

    first_timeout_s: float
    deadline_s: float
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    max_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0 < self.first_timeout_s <= self.max_timeout_s:
            raise ValueError(f"a retry policy needs 0 < first_timeout_s <= max_timeout_s: {self}")
        if self.deadline_s < self.first_timeout_s or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"a retry policy needs deadline_s >= first_timeout_s, backoffs >= 0: {self}")

    def attempt_timeout_s(self, attempt: int, first_s: float | None = None) -> float:
        """`first_s`: the first attempt's timeout when measured round trips raised it."""
        first = max(first_s or 0.0, self.first_timeout_s)
        return min(first * 2.0 ** (attempt - 1), max(self.max_timeout_s, first))

    def backoff_cap_s(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** (attempt - 1))


class RoundTrips:
    """Smoothed round-trip time of one kind of call (RFC 6298's estimator: srtt, rttvar).
    `timeout_s(floor)` is what the next first attempt should wait: never less than `floor` (the
    configured timeout), more when the calls have been slow lately."""

    def __init__(self) -> None:
        self.srtt_s: float | None = None
        self.rttvar_s = 0.0

    def observe(self, seconds: float) -> None:
        if self.srtt_s is None:
            self.srtt_s, self.rttvar_s = seconds, seconds / 2
            return
        self.rttvar_s = 0.75 * self.rttvar_s + 0.25 * abs(self.srtt_s - seconds)
        self.srtt_s = 0.875 * self.srtt_s + 0.125 * seconds

    def timeout_s(self, floor_s: float) -> float:
        if self.srtt_s is None:
            return floor_s
        return max(floor_s, self.srtt_s + 4.0 * self.rttvar_s)

    def deadline_s(self, floor_s: float) -> float:
        if self.srtt_s is None:
            return floor_s
        return max(floor_s, DEADLINE_ROUND_TRIPS * self.srtt_s)


class RetriesExhausted(RuntimeError):
    """Every attempt of a repeatable call failed before its deadline. Names the call, how many
    attempts it had over how long, and the last failure."""

    def __init__(self, what: str, attempts: int, elapsed_s: float, last: BaseException) -> None:
        super().__init__(f"{what}: {attempts} attempts over {elapsed_s:.0f}s all failed; last: {last}")
        self.what = what
        self.attempts = attempts
        self.elapsed_s = elapsed_s
        self.last = last


async def call_with_retry(
    what: str,
    attempt: Callable[[float], Awaitable[T]],
    policy: RetryPolicy,
    retriable: Callable[[BaseException], bool],
    *,
    round_trips: RoundTrips | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    rng: random.Random | None = None,
) -> T:
    """`attempt(timeout_s)` until it returns, a failure is not `retriable`, or the deadline is
    reached (then RetriesExhausted, chained to the last failure). Every repeat is logged with the
    attempt number; a success after repeats too."""
    rng = rng or random.Random()
    trips = round_trips or RoundTrips()
    deadline_s = trips.deadline_s(policy.deadline_s)
    first_s = trips.timeout_s(policy.first_timeout_s)
    start = clock()
    number = 0
    while True:
        number += 1
        # the last attempt ends with the deadline (one starts only while some of it is left)
        timeout = min(policy.attempt_timeout_s(number, first_s), deadline_s - (clock() - start))
        t0 = clock()
        try:
            result = await attempt(timeout)
        except Exception as exc:  # noqa: BLE001 - classified by `retriable`
            if not retriable(exc):
                raise
            elapsed = clock() - start
            pause = rng.uniform(0.0, policy.backoff_cap_s(number))
            if elapsed + pause >= deadline_s:
                raise RetriesExhausted(what, number, elapsed, exc) from exc
            logger.warning(
                "%s: attempt %d failed after %.1fs (%s); attempt %d in %.1fs (deadline %.0fs, %.0fs left)",
                what, number, clock() - t0, exc, number + 1, pause, deadline_s, deadline_s - elapsed,
            )  # fmt: skip
            await sleep(pause)
            continue
        trips.observe(clock() - t0)
        if number > 1:
            logger.info("%s: succeeded at attempt %d, %.1fs after the first", what, number, clock() - start)
        return result


async def wait_patiently(
    what: str,
    call: Awaitable[T],
    first_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Await one request that must not be sent twice, however long it takes (its own timeout is
    the deadline): a state-changing call whose late twin could land after the call that undoes
    it (a stale pause after its resume leaves a server paused for good). Logged each time it has
    waited twice as long as before (first_s, 2 first_s, 4 first_s, ...), so a slow machine shows
    in the log long before the deadline."""
    task = asyncio.ensure_future(call)
    start, window = clock(), first_s
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=window)
            if done:
                result = task.result()
                if clock() - start > first_s:
                    logger.info("%s: answered after %.1fs (not sent again)", what, clock() - start)
                return result
            logger.warning(
                "%s: no answer after %.1fs; still waiting for it (not sent again: a late twin "
                "could land after the call that undoes it)", what, clock() - start,
            )  # fmt: skip
            window *= 2
    finally:
        if not task.done():
            task.cancel()
