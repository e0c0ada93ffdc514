"""The tools a workflow may call (`EpisodeContext.call_tool(name, arguments)`): `python` and
`calculator`. A call never raises for anything the model wrote: every failure (an exception in
its program, a timeout, output over the cap, a malformed expression, an unknown tool) comes back
as one short line of text starting with "error:", which the workflow appends for the model to read.

- `python`: `arguments` is a program, run in the reward sandbox by a reward worker (the reward
  task `tool_python`, reward/tool_python.py): the same isolation, uid claim, rlimits, wall timeout
  and kill-on-overrun as a code reward, so no second sandbox exists to keep safe. Limits:
  `timeout_s` (WorkflowConfig.tool_timeout_s) and `output_chars` (WorkflowConfig.tool_output_chars).
- `calculator`: `arguments` is one arithmetic expression (numbers, + - * / // % **, parentheses),
  evaluated here, in the controller, by walking its `ast` with no eval: no name, call, attribute
  or subscript can be reached, so the expression cannot run code, and the sizes that could cost
  time or memory (a huge power, a huge number, a deep expression) are refused before any
  operation runs. Why not the sandbox: the built-in tool workflow calls it at every arithmetic
  step of many parallel episodes, and a sandboxed process costs tens of ms and a reward worker
  per call, while this costs microseconds and exposes nothing a sandbox would have to contain.
"""

from __future__ import annotations

import ast
import operator

from areal_jobs.api import RewardRequest, RewardScorer, RewardStatus
from areal_jobs.config import WorkflowConfig
from areal_jobs.reward.tool_python import TASK as PYTHON_TASK
from areal_jobs.reward.tool_python import tool_spec

TOOL_NAMES = ("calculator", "python")
MAX_EXPRESSION_CHARS = 200
MAX_INT_BITS = 4096  # bound on every operand and result: big-int work stays microseconds
MAX_DEPTH = 32  # nesting of the expression tree

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """A malformed or refused expression; its message is what the model reads after "error: "."""


class Toolbox:
    """The tools with one workflow config's limits; what EpisodeContext.call_tool delegates to."""

    def __init__(self, scorer: RewardScorer, timeout_s: float, output_chars: int) -> None:
        if timeout_s <= 0 or output_chars < 1:
            raise ValueError(
                "rollout.workflow.tool_timeout_s must be > 0 and rollout.workflow.tool_output_chars >= 1"
            )
        self._scorer = scorer
        self.timeout_s = timeout_s
        self.output_chars = output_chars

    async def call(self, name: str, arguments: str) -> str:
        """The tool's result as text for the model (errors included, as "error: ...")."""
        if name == "calculator":
            text = calculator(arguments)
            if len(text) > self.output_chars:  # a number of up to MAX_INT_BITS: ~1200 digits
                return f"{text[: self.output_chars]}\n[output truncated: over {self.output_chars} chars]"
            return text
        if name == "python":
            return await self._python(arguments)
        return f"error: unknown tool {name[:40]!r} (tools: {', '.join(TOOL_NAMES)})"

    async def _python(self, program: str) -> str:
        request = RewardRequest(PYTHON_TASK, program, tool_spec(self.timeout_s, self.output_chars))
        (result,) = await self._scorer.score_group([request])
        if result.output:
            return result.output
        # The worker itself overran reward.timeout_s (killed) or died: no text came back from it.
        if result.status is RewardStatus.timeout:
            return f"error: timed out after {self.timeout_s:g}s"
        return "error: the tool sandbox failed"


async def call_tool(name: str, arguments: str, config: WorkflowConfig) -> str:
    """EpisodeContext's fallback when the controller lends no tool runner (rollout/main.py lends
    `Toolbox(scorer, ...).call`): without a reward service the python tool cannot run, so only the
    calculator answers; `python` says so as text."""
    if name == "python":
        return "error: the python tool needs the reward service (no tool runner was configured)"
    return await Toolbox(_NoSandbox(), config.tool_timeout_s, config.tool_output_chars).call(name, arguments)


class _NoSandbox:
    async def score_group(self, requests):  # never reached: call_tool answers python itself
        raise RuntimeError("no reward service")


def calculator(expression: str) -> str:
    """The value of `expression` as text ("7", "2.5"), or "error: <why>"."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: expression longer than {MAX_EXPRESSION_CHARS} chars"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):  # ValueError: a NUL byte
        return "error: not an arithmetic expression"
    try:
        value = _evaluate(tree.body, 0)
    except CalculatorError as e:
        return f"error: {e}"
    except ZeroDivisionError:
        return "error: division by zero"
    except OverflowError:
        return "error: result too large"
    return repr(value)


def _evaluate(node: ast.expr, depth: int) -> int | float:
    if depth > MAX_DEPTH:
        raise CalculatorError(f"expression nested deeper than {MAX_DEPTH}")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, not complex
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(_BINARY[type(node.op)](left, right))
    raise CalculatorError(f"unsupported {type(node).__name__} (numbers and + - * / // % ** only)")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose result would exceed MAX_INT_BITS before computing it."""
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1:
        if exponent * (abs(base).bit_length() - 1) > MAX_INT_BITS:
            raise CalculatorError("result too large")
    if isinstance(exponent, int) and exponent < 0 and base == 0:
        raise ZeroDivisionError
    if isinstance(base, int | float) and base < 0 and not float(exponent).is_integer():
        raise CalculatorError("fractional power of a negative number")


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError("result too large")
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        raise CalculatorError("result is not a finite number")
    return value
