"""The `python` tool's sandboxed half: runs a model's program in the code sandbox and turns what
happened into the short text the model reads next.

It runs inside a reward worker, registered in reward/registry.py as the task `tool_python`
(response = the program, reference = JSON {"timeout_s", "output_chars"}), so a tool call gets
exactly what a code reward gets: the worker's claimed sandbox uid as root, userns as non-root,
the start-up self-check, the isolation mode in force, and a worker that is killed and replaced
when a call overruns reward.timeout_s. agent/tools.py is the controller's half.

The program runs like a REPL cell: if its last statement is an expression, its repr is printed
(unless None), so `2**10` answers `1024`. That wrapper (_RUNNER) also runs in the sandbox: the
worker never parses or executes the model's code.

What the model reads (`result.output`, at most about output_chars + one status line):
- stdout, cut at output_chars with "[output truncated: over N chars]" (the program is killed at
  4 * output_chars + 4 KiB bytes of stdout + stderr, so a flood costs nothing);
- after an uncaught exception, "error: <its last traceback line>", e.g. "error: ZeroDivisionError:
  division by zero";
- "error: timed out after Ns" (wall clock or CPU limit), with what it printed before;
- "error: the tool sandbox failed" when the sandbox itself could not run it (status sandbox_error).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

from areal_jobs.api import RewardResult, RewardStatus
from areal_jobs.reward import code
from areal_jobs.reward.sandbox import SandboxRun, run_program

TASK = "tool_python"
_CAP_SLACK_BYTES = 4096  # room for a traceback beside output_chars of stdout before the kill
_RUNNER = """
import ast
with open("tool.py", encoding="utf-8") as f:
    tree = ast.parse(f.read(), "tool.py")
last = None
if tree.body and isinstance(tree.body[-1], ast.Expr):
    last = ast.Expression(tree.body.pop().value)
scope = {"__name__": "__main__"}
exec(compile(tree, "tool.py", "exec"), scope)
if last is not None:
    value = eval(compile(last, "tool.py", "eval"), scope)
    if value is not None:
        print(repr(value))
"""


def tool_spec(timeout_s: float, output_chars: int) -> str:
    """The `reference` of a tool_python request."""
    return json.dumps({"timeout_s": timeout_s, "output_chars": output_chars})


def run_python_tool(program: str, spec: str) -> RewardResult:
    """RewardFn for `tool_python`: reward is always 0.0; `output` is the text for the model."""
    limits_in = json.loads(spec)
    timeout_s, output_chars = float(limits_in["timeout_s"]), int(limits_in["output_chars"])
    limits = replace(
        code.worker_limits(),
        wall_timeout_s=timeout_s,
        cpu_s=max(1, math.ceil(timeout_s)),
        max_output_bytes=4 * output_chars + _CAP_SLACK_BYTES,  # UTF-8: at most 4 bytes a char
    )
    run = run_program({"main.py": _RUNNER, "tool.py": program}, b"", limits)
    status = RewardStatus.ok
    if not run.started:
        status = RewardStatus.sandbox_error
    elif run.timed_out:
        status = RewardStatus.timeout
    return RewardResult(0.0, status, "python tool", output=tool_text(run, timeout_s, output_chars))


def tool_text(run: SandboxRun, timeout_s: float, output_chars: int) -> str:
    """What the model reads after the run (see the module docstring)."""
    if not run.started:
        return "error: the tool sandbox failed"
    out = run.stdout.decode("utf-8", errors="replace")
    lines = []
    if len(out) > output_chars or run.output_capped:  # capped: stdout + stderr passed the byte cap
        lines += [out[:output_chars]] if out else []
        lines.append(f"[output truncated: over {output_chars} chars]")
    elif out:
        lines.append(out.rstrip("\n"))
    if run.timed_out:
        lines.append(f"error: timed out after {timeout_s:g}s")
    elif not run.output_capped and run.returncode != 0:
        lines.append(f"error: {_last_error_line(run)}")
    return "\n".join(lines) if lines else "(no output)"


def _last_error_line(run: SandboxRun) -> str:
    """The exception line of a traceback ("ValueError: bad"), or how the program ended."""
    err = run.stderr.decode("utf-8", errors="replace").strip().splitlines()
    if err:
        return err[-1][:200]
    if run.returncode is not None and run.returncode < 0:
        return f"killed by signal {-run.returncode}"
    return f"exit status {run.returncode}"
