"""transport/retry.py: repeats with doubling attempt timeouts, full-jitter backoff, one deadline,
and a deadline that grows with the round trips measured lately. A fake clock: nothing sleeps."""

from __future__ import annotations

import asyncio
import random

import pytest

from areal_jobs.transport.retry import (
    DEADLINE_ROUND_TRIPS,
    RetriesExhausted,
    RetryPolicy,
    RoundTrips,
    call_with_retry,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Flaky:
    """Times out (spending the whole attempt's timeout) `failures` times, then answers."""

    def __init__(self, clock: Clock, failures: int, error: type[Exception] = TimeoutError) -> None:
        self.clock, self.failures, self.error = clock, failures, error
        self.timeouts: list[float] = []

    async def __call__(self, timeout_s: float) -> str:
        self.timeouts.append(timeout_s)
        if len(self.timeouts) <= self.failures:
            self.clock.now += timeout_s
            raise self.error(f"attempt {len(self.timeouts)} timed out")
        self.clock.now += 0.01
        return "done"


POLICY = RetryPolicy(
    first_timeout_s=1.0, deadline_s=60.0, backoff_s=0.5, max_backoff_s=4.0, max_timeout_s=8.0
)


def run(attempt, policy=POLICY, clock=None, trips=None, retriable=lambda e: isinstance(e, TimeoutError)):
    clock = clock or attempt.clock
    return asyncio.run(
        call_with_retry(
            "pause generation on server 0",
            attempt,
            policy,
            retriable,
            round_trips=trips,
            clock=clock,
            sleep=clock.sleep,
            rng=random.Random(0),
        )  # fmt: skip
    )


def test_attempt_timeouts_double_up_to_the_cap_and_backoffs_stay_within_their_growing_bounds():
    clock = Clock()
    attempt = Flaky(clock, failures=5)
    assert run(attempt) == "done"
    assert attempt.timeouts == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    caps = [0.5, 1.0, 2.0, 4.0, 4.0]
    assert len(clock.sleeps) == 5 and all(0 <= s <= cap for s, cap in zip(clock.sleeps, caps))
    assert len(set(clock.sleeps)) == 5  # jittered: callers that fail together do not retry in step


def test_the_deadline_ends_the_repeats_with_the_attempt_count_and_the_last_failure():
    clock = Clock()
    attempt = Flaky(clock, failures=1000)
    with pytest.raises(RetriesExhausted) as info:
        run(attempt)
    exc = info.value
    assert exc.attempts == len(attempt.timeouts) and exc.attempts >= 8
    assert exc.elapsed_s <= POLICY.deadline_s and clock.now <= POLICY.deadline_s + 1e-9
    assert "pause generation on server 0" in str(exc) and "timed out" in str(exc)
    assert isinstance(exc.__cause__, TimeoutError)
    # the last attempt ends with the deadline, it does not overrun it
    assert sum(attempt.timeouts) + sum(clock.sleeps) <= POLICY.deadline_s + 1e-9


def test_a_failure_that_is_not_retriable_is_raised_at_once():
    clock = Clock()
    attempt = Flaky(clock, failures=3, error=ValueError)
    with pytest.raises(ValueError, match="attempt 1"):
        run(attempt)
    assert attempt.timeouts == [1.0] and clock.sleeps == []


def test_slow_round_trips_lengthen_the_first_attempt_and_the_deadline():
    trips = RoundTrips()
    assert trips.timeout_s(1.0) == 1.0 and trips.deadline_s(60.0) == 60.0  # nothing measured yet
    for seconds in (5.0, 5.0, 5.0, 5.0):  # every call took 5 s lately: a starved machine
        trips.observe(seconds)
    assert trips.srtt_s == pytest.approx(5.0)
    assert trips.timeout_s(1.0) >= 5.0
    assert trips.deadline_s(60.0) == pytest.approx(DEADLINE_ROUND_TRIPS * 5.0)
    clock = Clock()
    attempt = Flaky(clock, failures=1)
    run(attempt, policy=RetryPolicy(first_timeout_s=1.0, deadline_s=60.0, max_timeout_s=100.0), trips=trips)
    assert attempt.timeouts[0] >= 5.0 and attempt.timeouts[1] == 2 * attempt.timeouts[0]


def test_each_success_is_measured():
    trips, clock = RoundTrips(), Clock()
    run(Flaky(clock, failures=0), trips=trips)
    assert trips.srtt_s == pytest.approx(0.01)


@pytest.mark.parametrize(
    "kwargs",
    [dict(first_timeout_s=0, deadline_s=1), dict(first_timeout_s=2, deadline_s=1), dict(first_timeout_s=1, deadline_s=5, backoff_s=-1)],
)  # fmt: skip
def test_bad_policies_are_refused(kwargs):
    with pytest.raises(ValueError, match="retry policy"):
        RetryPolicy(**kwargs)
