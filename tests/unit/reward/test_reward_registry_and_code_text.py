"""Reward registry contract and the pure text handling of the code graders."""

from __future__ import annotations

import pytest

from areal_jobs.api import RewardResult
from areal_jobs.reward import registry
from areal_jobs.reward.code import extract_program


def test_registry_names_every_task() -> None:
    assert set(registry.REWARD_TARGETS) >= {"gsm8k", "math", "humaneval", "code_stdio", "arith"}
    for target in registry.REWARD_TARGETS.values():
        module, sep, attr = target.partition(":")
        assert sep and module and attr.isidentifier(), target


def test_unknown_task_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="humaneval"):
        registry.target("humaneval_plus")


@pytest.mark.parametrize("task", ["gsm8k", "math", "humaneval", "code_stdio"])
def test_registered_reward_functions_resolve(task: str) -> None:
    assert callable(registry.resolve(task))


def test_math_rewards_through_the_registry() -> None:
    result = registry.resolve("gsm8k")("so she makes $18.\n#### 18", "18")
    assert isinstance(result, RewardResult) and result.reward == 1.0


def test_arith_contract() -> None:
    fn = registry.resolve("arith")
    for response in ("The answer is 7.", "no idea", ""):
        result = fn(response, "7")
        assert isinstance(result, RewardResult)
        assert 0.0 <= result.reward <= 1.0
    assert fn("no idea", "7").reward == 0.0


@pytest.mark.parametrize(
    ("response", "program"),
    [
        ("print(1)\n", "print(1)\n"),
        ("Here:\n```python\nprint(1)\n```\nDone.", "print(1)\n"),
        ("```py\nx = 1\n```\nbetter:\n```python\nx = 2\n```", "x = 2\n"),
        ("```\nprint(2)\n```", "print(2)\n"),
        ("truncated:\n```python\nprint(3)\n", "print(3)\n"),
    ],
)
def test_extract_program(response: str, program: str) -> None:
    assert extract_program(response) == program
