"""Reward registry: task name -> "module:function" of a RewardFn, or a user's own function.

Targets are strings so a request stays small and picklable, and the function is imported inside
the worker process that runs it (`resolve`). A new built-in reward is one line here plus a
contract test that loads it through `resolve`, the same way the service does.

A task may also be a user function spec (reward.function, a mixture source's `reward`):
`path/to/rewards.py:compute_score`, `path/to/rewards.py` (compute_score) or `package.module:fn`,
with our signature or verl's (reward/user_fn.py; `resolve_user` loads it, cached per process).
"""

from __future__ import annotations

import functools
import importlib

from areal_jobs.api import RewardFn
from areal_jobs.reward.user_fn import UserFunction, is_function_spec, load, parse_spec

REWARD_TARGETS: dict[str, str] = {
    "gsm8k": "areal_jobs.reward.math_answer:reward_math",
    "math": "areal_jobs.reward.math_answer:reward_math",
    "humaneval": "areal_jobs.reward.code:reward_humaneval",
    "code_stdio": "areal_jobs.reward.code:reward_code_stdio",
    "arith": "areal_jobs.tasks.arith_task:reward",
    "countdown": "areal_jobs.reward.countdown:reward_countdown",
    # not a reward: the sandboxed `python` tool of agent/tools.py, run by the same workers
    "tool_python": "areal_jobs.reward.tool_python:run_python_tool",
}


def target(task: str) -> str:
    """The "module:function" for `task` (a user spec as written); ValueError naming the known
    tasks otherwise. Pure: nothing is imported."""
    if is_function_spec(task):
        return parse_spec(task).text
    try:
        return REWARD_TARGETS[task]
    except KeyError:
        raise ValueError(
            f"unknown reward task {task!r}: expected one of {sorted(REWARD_TARGETS)} "
            "or a function of your own, path/to/rewards.py:compute_score"
        ) from None


def has_checker(task: str) -> bool:
    """Whether the reward workers can run `task` (a built-in target or a user function)."""
    return task in REWARD_TARGETS or is_function_spec(task)


def resolve_user(task: str) -> UserFunction:
    """Import a user function spec (UserFunctionError naming reward.function when it cannot be
    used); call the result as fn(response, reference, data_source, extra_info)."""
    return load(task)


@functools.cache
def resolve(task: str) -> RewardFn:
    """Import and return the reward function registered for `task` (cached per process). A user
    function spec resolves to a (response, reference) callable: its data_source is "" and its
    extra_info {} (the reward service passes the request's own through `resolve_user`)."""
    if is_function_spec(task):
        return load(task)
    module_name, _, attr = target(task).partition(":")
    fn = getattr(importlib.import_module(module_name), attr)
    if not callable(fn):
        raise TypeError(f"reward target {target(task)} is not callable")
    return fn
