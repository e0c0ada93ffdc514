"""The reward service's side of users' reward functions (reward.function, reward/user_fn.py):
what a failure the worker could not report itself becomes, the first failure of each function
logged once with its traceback (later ones are only counted, by status), and the means of what the
functions return beside their score (reward/fn/<key>, over the calls since the previous report)."""

from __future__ import annotations

import logging

from areal_jobs.api import RewardResult, RewardStatus

logger = logging.getLogger("areal_jobs.reward.service")

FAILED = frozenset({RewardStatus.fn_error, RewardStatus.fn_timeout, RewardStatus.fn_invalid})


class FnReport:
    def __init__(self) -> None:
        self._sums: dict[str, list[float]] = {}  # key -> [sum, count] since the last metrics()
        self._logged: set[str] = set()  # functions whose first failure has been logged

    def timed_out(self, task: str, timeout_s: float) -> RewardResult:
        """The call ran past reward.timeout_s (its worker is killed)."""
        result = RewardResult(
            0.0, RewardStatus.fn_timeout, f"reward.function={task} ran past reward.timeout_s={timeout_s:g}"
        )
        self.on_result(task, result, "")
        return result

    def worker_died(self, task: str, exit_code: int | None) -> RewardResult:
        """The user's code took its worker down (os._exit, a crash in an extension)."""
        result = RewardResult(
            0.0, RewardStatus.fn_error, f"reward.function={task}: its worker died (exit code {exit_code})"
        )
        self.on_result(task, result, "")
        return result

    def on_result(self, task: str, result: RewardResult, trace: str) -> None:
        for key, value in result.metrics:
            acc = self._sums.setdefault(key, [0.0, 0])
            acc[0] += value
            acc[1] += 1
        if result.status not in FAILED or task in self._logged:
            return
        self._logged.add(task)
        logger.error(
            "reward function %s failed (%s): %s; the sample is left out of training; later failures "
            "are counted (reward/fn_errors, reward/fn_timeouts, reward/fn_invalid), not logged%s",
            task, result.status.value, result.detail, f"\n{trace.rstrip()}" if trace else "",
        )  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """reward/fn/<key>: the mean of each extra value since the previous call."""
        means = {f"reward/fn/{key}": total / count for key, (total, count) in self._sums.items()}
        self._sums.clear()
        return means
