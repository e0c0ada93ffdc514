"""The calculator (evaluated in-process, with no eval) and the text the python tool's runs become,
with hand-worked values. The sandboxed runs themselves: tests/integration/reward/test_reward_tools.py."""

from __future__ import annotations

import asyncio

import pytest

from areal_jobs.agent.tools import MAX_EXPRESSION_CHARS, Toolbox, calculator, call_tool
from areal_jobs.api import RewardResult, RewardStatus
from areal_jobs.config import WorkflowConfig
from areal_jobs.reward.sandbox import SandboxRun
from areal_jobs.reward.tool_python import tool_text
from areal_jobs.tasks import arith_task
from areal_jobs.tasks.arith_tools import call_expression


@pytest.mark.parametrize(
    ("expression", "text"),
    [
        ("(8+3)%10", "1"),
        ("(0-9)%10", "1"),  # Python's modulo of a negative number: 1, the dial's answer
        ("7 - 6", "1"),
        ("2**10", "1024"),
        ("7/2", "3.5"),
        ("7//2", "3"),
        ("-(2+3)*4", "-20"),
        ("0.5 + 0.25", "0.75"),
        ("1/0", "error: division by zero"),
        ("5 % 0", "error: division by zero"),
        ("0 ** -1", "error: division by zero"),
        ("2 ** 100000", "error: result too large"),  # refused before it is computed
        ("9 ** 9 ** 9", "error: result too large"),
        ("1e308 * 10", "error: result is not a finite number"),
        ("(-8) ** 0.5", "error: fractional power of a negative number"),
        ("(8+", "error: not an arithmetic expression"),
        ("", "error: not an arithmetic expression"),
        ("__import__('os').system('id')", "error: unsupported Call (numbers and + - * / // % ** only)"),
        ("x + 1", "error: unsupported Name (numbers and + - * / // % ** only)"),
        ("True + 1", "error: unsupported Constant (numbers and + - * / // % ** only)"),
        ("'a' * 3", "error: unsupported Constant (numbers and + - * / // % ** only)"),
        ("1 << 5", "error: unsupported BinOp (numbers and + - * / // % ** only)"),
        ("(1).real", "error: unsupported Attribute (numbers and + - * / // % ** only)"),
    ],
)
def test_calculator(expression: str, text: str) -> None:
    assert calculator(expression) == text


def test_calculator_refuses_long_and_deep_expressions() -> None:
    assert calculator("1+" * 100 + "1") == f"error: expression longer than {MAX_EXPRESSION_CHARS} chars"
    assert calculator("(" * 40 + "1" + ")" * 40) == "1"  # parentheses are not nodes
    assert calculator("-" * 40 + "1") == "error: expression nested deeper than 32"


def test_the_calculator_answers_every_arith_step_with_its_right_digit() -> None:
    """The warm start appends str(right) after a call (tasks/arith_tools.py): the calculator must
    produce exactly that text for all 60 facts, or the workflow would append other tokens."""
    for value in range(arith_task.MODULUS):
        for sign in "+-":
            for operand in range(1, arith_task.MAX_OPERAND + 1):
                right = (value + operand if sign == "+" else value - operand) % arith_task.MODULUS
                assert calculator(call_expression(value, sign, operand)) == str(right)


def run(stdout: bytes = b"", stderr: bytes = b"", returncode: int = 0, **kw) -> SandboxRun:
    return SandboxRun(True, returncode, stdout, stderr, **kw)


def test_tool_text() -> None:
    assert tool_text(run(b"42\n"), 5.0, 16) == "42"
    assert tool_text(run(), 5.0, 16) == "(no output)"
    traceback = (
        b'Traceback (most recent call last):\n  File "tool.py", line 1\nZeroDivisionError: division by zero\n'
    )
    assert tool_text(run(b"a\n", traceback, 1), 5.0, 16) == "a\nerror: ZeroDivisionError: division by zero"
    assert tool_text(run(b"x" * 20), 5.0, 16) == "x" * 16 + "\n[output truncated: over 16 chars]"
    capped = run(b"y" * 9, returncode=-9, output_capped=True)  # killed at the byte cap: no error line
    assert tool_text(capped, 5.0, 16) == "y" * 9 + "\n[output truncated: over 16 chars]"
    assert (
        tool_text(run(b"", b"e" * 99, -9, output_capped=True), 5.0, 16) == "[output truncated: over 16 chars]"
    )
    slow = run(b"partial\n", returncode=-9, timed_out=True)
    assert tool_text(slow, 2.5, 16) == "partial\nerror: timed out after 2.5s"
    assert tool_text(run(returncode=-11), 5.0, 16) == "error: killed by signal 11"
    assert tool_text(SandboxRun(False, None, error="boom"), 5.0, 16) == "error: the tool sandbox failed"


class FakeScorer:
    """Answers tool_python like a reward worker whose call overran reward.timeout_s (or died)."""

    def __init__(self, result: RewardResult) -> None:
        self.result = result
        self.requests = []

    async def score_group(self, requests):
        self.requests += list(requests)
        return [self.result for _ in requests]

    def metrics(self):
        return {}


def test_toolbox_dispatch_and_errors_as_text() -> None:
    scorer = FakeScorer(RewardResult(0.0, RewardStatus.ok, "python tool", output="3"))
    box = Toolbox(scorer, timeout_s=2.0, output_chars=16)
    assert asyncio.run(box.call("calculator", "1+2")) == "3"
    big = calculator("2**4000")  # 1205 digits
    assert asyncio.run(box.call("calculator", "2**4000")) == big[:16] + "\n[output truncated: over 16 chars]"
    assert asyncio.run(box.call("python", "print(1+2)")) == "3"
    assert [(r.task, r.response) for r in scorer.requests] == [("tool_python", "print(1+2)")]
    assert asyncio.run(box.call("shell", "ls")) == "error: unknown tool 'shell' (tools: calculator, python)"
    scorer.result = RewardResult(0.0, RewardStatus.timeout, "reward call exceeded 30s")
    assert asyncio.run(box.call("python", "while True: pass")) == "error: timed out after 2s"
    scorer.result = RewardResult(0.0, RewardStatus.sandbox_error, "reward worker died (exit code -9)")
    assert asyncio.run(box.call("python", "1")) == "error: the tool sandbox failed"
    with pytest.raises(ValueError, match="rollout.workflow.tool_timeout_s"):
        Toolbox(scorer, timeout_s=0.0, output_chars=16)


def test_the_fallback_without_a_tool_runner_answers_the_calculator_only() -> None:
    config = WorkflowConfig(name="tool_arith", tool_output_chars=8)
    assert asyncio.run(call_tool("calculator", "(8+3)%10", config)) == "1"
    assert (
        asyncio.run(call_tool("calculator", "2**64", config)) == "18446744\n[output truncated: over 8 chars]"
    )
    assert asyncio.run(call_tool("python", "1", config)).startswith(
        "error: the python tool needs the reward service"
    )
    assert asyncio.run(call_tool("shell", "ls", config)).startswith("error: unknown tool 'shell'")
