"""Reward registry: task name -> "module:function" of a RewardFn.

Targets are strings so a request stays small and picklable, and the function is imported inside
the worker process that runs it (`resolve`). A new reward is one line here plus a contract test
that loads it through `resolve`, the same way the service does.
"""

from __future__ import annotations

import functools
import importlib

from areal_jobs.api import RewardFn

REWARD_TARGETS: dict[str, str] = {
    "gsm8k": "areal_jobs.reward.math_answer:reward_math",
    "math": "areal_jobs.reward.math_answer:reward_math",
    "humaneval": "areal_jobs.reward.code:reward_humaneval",
    "code_stdio": "areal_jobs.reward.code:reward_code_stdio",
    "arith": "areal_jobs.data.arith_task:reward",
    "countdown": "areal_jobs.reward.countdown:reward_countdown",
    # not a reward: the sandboxed `python` tool of agent/tools.py, run by the same workers
    "tool_python": "areal_jobs.reward.tool_python:run_python_tool",
}


def target(task: str) -> str:
    """The "module:function" for `task`; ValueError naming the known tasks otherwise."""
    try:
        return REWARD_TARGETS[task]
    except KeyError:
        raise ValueError(f"unknown reward task {task!r}: expected one of {sorted(REWARD_TARGETS)}") from None


@functools.cache
def resolve(task: str) -> RewardFn:
    """Import and return the reward function registered for `task` (cached per process)."""
    module_name, _, attr = target(task).partition(":")
    fn = getattr(importlib.import_module(module_name), attr)
    if not callable(fn):
        raise TypeError(f"reward target {target(task)} is not callable")
    return fn
