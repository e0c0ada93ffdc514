"""RewardService with real worker processes: ordering, metrics, parallelism, a free event loop,
call timeouts, worker crashes, cancellation, and the registry contract through the pool."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from areal_jobs.api import RewardRequest, RewardResult, RewardStatus
from areal_jobs.config import RewardConfig
from areal_jobs.reward.service import RewardService

POLL_STEPS = 1000  # bounded polling: at most POLL_STEPS * 10 ms
ECHO = json.dumps({"tests": [{"input": "hi\n", "output": "hi\n"}]})


def sleeper(seconds: float) -> RewardRequest:
    return RewardRequest("code_stdio", f"import time\ntime.sleep({seconds})\nprint(input())", ECHO)


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after[key] - before[key]


async def wait_for_busy(service: RewardService, busy: int) -> bool:
    for _ in range(POLL_STEPS):
        if service.metrics()["reward/busy_workers"] >= busy:
            return True
        await asyncio.sleep(0.01)
    return False


def test_results_come_back_in_order_and_every_status_is_counted(scorer) -> None:
    before = scorer.service.metrics()
    requests = [
        RewardRequest("gsm8k", "She makes 9 * 2 = $18.\n#### 18", "18"),
        RewardRequest("math", "\\boxed{3}", "4"),
        RewardRequest("math", "no final answer here", "4"),
        RewardRequest("code_stdio", "print(input())", ECHO),
        RewardRequest("code_stdio", "while True:\n    pass", ECHO),
        RewardRequest("humaneval", "    return 1\n", "this is not a JSON spec"),
    ]
    results = scorer.score(requests)
    assert [(r.reward, r.status) for r in results] == [
        (1.0, RewardStatus.ok),
        (0.0, RewardStatus.ok),
        (0.0, RewardStatus.parse_error),
        (1.0, RewardStatus.ok),
        (0.0, RewardStatus.timeout),
        (0.0, RewardStatus.grader_error),  # a broken reference, not a wrong answer
    ]
    after = scorer.service.metrics()
    assert delta(before, after, "reward/calls") == 6
    assert delta(before, after, "reward/ok") == 3
    assert delta(before, after, "reward/parse_errors") == 1
    assert delta(before, after, "reward/timeouts") == 1
    assert delta(before, after, "reward/grader_errors") == 1
    assert delta(before, after, "reward/sandbox_errors") == 0
    assert after["reward/mean_latency_s"] > 0


def test_unknown_task_is_a_config_error_raised_before_any_work(scorer) -> None:
    before = scorer.service.metrics()["reward/calls"]
    with pytest.raises(ValueError, match="expected one of"):
        scorer.score([RewardRequest("gsm8k", "#### 1", "1"), RewardRequest("nope", "", "")])
    assert scorer.service.metrics()["reward/calls"] == before


def test_scoring_needs_start() -> None:
    service = RewardService(RewardConfig())  # the constructor does no I/O and starts nothing
    assert service.worker_pids() == []
    with pytest.raises(RuntimeError, match="start"):
        asyncio.run(service.score_group([RewardRequest("math", "\\boxed{1}", "1")]))


def test_group_runs_in_parallel_and_the_event_loop_stays_free(scorer) -> None:
    async def scenario() -> tuple[bool, int, bool, list[RewardResult]]:
        group = asyncio.ensure_future(scorer.service.score_group([sleeper(1.5), sleeper(1.5)]))
        both_busy = await wait_for_busy(scorer.service, 2)  # both workers hold a request at once
        ticks = 0
        while not group.done() and ticks < 20:
            await asyncio.sleep(0.01)  # only runs if the loop is not blocked by the reward calls
            ticks += 1
        ticked_while_running = ticks == 20 and not group.done()
        return both_busy, ticks, ticked_while_running, await group

    both_busy, _, ticked_while_running, results = scorer.loop.run_until_complete(scenario())
    assert both_busy
    assert ticked_while_running
    assert [r.reward for r in results] == [1.0, 1.0]


def test_worker_crash_is_a_sandbox_error_and_the_worker_is_replaced(
    scorer, leftover_sandbox_processes
) -> None:
    before = scorer.service.metrics()

    async def scenario() -> list[RewardResult]:
        group = asyncio.ensure_future(scorer.service.score_group([sleeper(2.5), sleeper(2.5)]))
        assert await wait_for_busy(scorer.service, 2)
        os.kill(scorer.service.worker_pids()[0], signal.SIGKILL)
        return await group

    results = scorer.loop.run_until_complete(scenario())
    assert sorted(r.status.value for r in results) == ["ok", "sandbox_error"]
    assert any("worker died" in r.detail for r in results)
    after = scorer.service.metrics()
    assert delta(before, after, "reward/sandbox_errors") == 1
    assert delta(before, after, "reward/worker_restarts") == 1
    assert leftover_sandbox_processes() == []  # the dead worker's sandbox died with it
    assert [r.reward for r in scorer.score([RewardRequest("code_stdio", "print(input())", ECHO)] * 2)] == [
        1.0,
        1.0,
    ]


def test_cancelled_group_does_not_leave_stale_replies(scorer) -> None:
    async def scenario() -> list[RewardResult]:
        group = asyncio.ensure_future(scorer.service.score_group([sleeper(2.0), sleeper(2.0)]))
        assert await wait_for_busy(scorer.service, 2)
        group.cancel()
        with pytest.raises(asyncio.CancelledError):
            await group
        return await scorer.service.score_group(
            [RewardRequest("math", "\\boxed{5}", "5"), RewardRequest("math", "\\boxed{6}", "7")]
        )

    results = scorer.loop.run_until_complete(scenario())
    assert [(r.reward, r.detail) for r in results] == [(1.0, "equivalent"), (0.0, "not equivalent")]


def test_call_past_timeout_is_counted_and_its_worker_replaced(scorer_factory, small_limits) -> None:
    cfg = RewardConfig(num_workers=1, **{**small_limits, "code_wall_timeout_s": 3.0, "timeout_s": 4.0})
    three_slow_cases = json.dumps({"tests": [{"input": "x\n", "output": "x\n"}] * 3})
    slow = RewardRequest("code_stdio", "import time\ntime.sleep(2.0)\nprint(input())", three_slow_cases)
    with scorer_factory(cfg) as s:
        old_pid = s.service.worker_pids()
        [result] = s.score([slow])  # each case fits the 3 s program limit; all three miss the 4 s call limit
        assert (result.reward, result.status) == (0.0, RewardStatus.timeout)
        assert "exceeded" in result.detail
        assert s.service.worker_pids() != old_pid
        metrics = s.service.metrics()
        assert (metrics["reward/timeouts"], metrics["reward/worker_restarts"]) == (1.0, 1.0)
        assert s.score([RewardRequest("math", "\\boxed{2}", "2")])[0].reward == 1.0


def test_arith_contract_through_the_pool(scorer) -> None:
    results = scorer.score(
        [RewardRequest("arith", "The answer is 7.", "7"), RewardRequest("arith", "?", "7")]
    )
    assert all(isinstance(r, RewardResult) and 0.0 <= r.reward <= 1.0 for r in results)
    assert results[1].reward == 0.0
    assert all(r.status is not RewardStatus.sandbox_error for r in results)
