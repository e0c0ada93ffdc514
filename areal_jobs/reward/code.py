"""Code rewards, graded by running the program in the sandbox. Reward 1.0 only if every test passes.

- `reward_humaneval(response, reference)`: `reference` is JSON {"prompt", "test", "entry_point"};
  `response` is the completion that follows the prompt, or a whole `def <entry_point>(...)`.
- `reward_code_stdio(response, reference)`: `reference` is JSON {"tests": [{"input", "output"}]};
  `response` is a whole program. Each test case runs in a fresh sandbox; outputs are compared line
  by line with trailing whitespace and trailing blank lines ignored.
In both, a ```python fenced block in the response is used if present (the last one).

Statuses: `timeout` when a program hits the wall-clock or CPU limit, `sandbox_error` when the
sandbox itself failed, `parse_error` when the response holds no code, `grader_error` when the
reference cannot grade anything (its prompt + test does not compile, the prompt lacks the entry
point, the test defines no `check`, or executing the test module fails); otherwise `ok`, with 0.0
or 1.0. A grader error never looks like a wrong answer. `humaneval_reference_problem` finds the
static ones without running anything; the rollout calls it on every row at data-load time.

A prompt may end at the signature (no docstring, no body): for the test module, and before a
completion that restates the whole function, its last function gets a `pass` body, so neither
the harness nor the candidate's own program trips on an IndentationError.

HumanEval runs the candidate and its tests in one interpreter, so a hostile candidate could try to
fake a pass. The harness (written by us, see _HARNESS) makes that hard for the known tricks:
- success is a random nonce printed after `check` returns. The nonce arrives on a stdin pipe and is
  read before the candidate runs, so `os._exit(0)`, `sys.exit`, atexit hooks or a swallowed
  exception give no nonce and no reward;
- `check` comes from the test, executed with the (trusted) prompt in its own namespace after the
  candidate, so the candidate cannot shadow `check` or any name the test uses; the test sees only
  the guarded entry point; builtins are restored after every candidate call;
- every value the candidate returns must be of a plain built-in type (exactly int, str, list, ...),
  so an object whose __eq__ always says True cannot satisfy `assert candidate(x) == y`;
- `assert` is a statement that cannot be rebound, and -I ignores PYTHONOPTIMIZE.
Limit: code that walks the interpreter's frames or heap to find the nonce can still forge a pass;
only an out-of-process check would stop that, which HumanEval's format does not allow.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import secrets

from areal_jobs.api import RewardResult, RewardStatus
from areal_jobs.reward.sandbox import SandboxLimits, SandboxRun, run_program

# RewardFn takes (response, reference) only, so a worker installs its limits once at start-up.
_limits = SandboxLimits()

_FENCE_RE = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)

# Trusted harness; runs as main.py. The call with the program, prompt, test and entry point is
# appended by _humaneval_source. Names bound here are captured before any candidate code runs.
_HARNESS = r"""
import builtins as _builtins
import os as _os
import sys as _sys


def _areal_harness(program, prompt, test, entry_point):
    write, builtins_dict = _os.write, _builtins.__dict__
    saved_builtins = dict(builtins_dict)
    nonce = _sys.stdin.buffer.readline().strip()
    plain_atoms = (type(None), bool, int, float, complex, str, bytes)
    plain_containers = (list, tuple, set, frozenset, dict)

    def restore_builtins():
        for name, value in saved_builtins.items():
            if builtins_dict.get(name) is not value:
                builtins_dict[name] = value

    def require_plain(value, depth=0):
        kind = type(value)
        if kind in plain_atoms:
            return
        if kind not in plain_containers or depth > 50:
            raise TypeError("candidate returned a value of type %s, not a plain built-in" % kind.__name__)
        items = value.items() if kind is dict else ((v, None) for v in value)
        for key, item in items:
            require_plain(key, depth + 1)
            require_plain(item, depth + 1)

    candidate_ns = {"__name__": "__candidate__"}
    exec(compile(program, "solution.py", "exec"), candidate_ns)
    restore_builtins()
    candidate = candidate_ns[entry_point]

    def guarded(*args, **kwargs):
        result = candidate(*args, **kwargs)
        restore_builtins()
        require_plain(result)
        return result

    test_ns = {"__name__": "__test__"}
    try:
        exec(compile(prompt + "\n" + test, "test.py", "exec"), test_ns)
        check = test_ns["check"]
    except BaseException:
        write(1, b"\nG" + nonce + b"\n")  # the test module itself failed: a grader error
        raise
    test_ns[entry_point] = guarded  # some tests call the function by name, not as `candidate`
    check(guarded)
    write(1, b"\n" + nonce + b"\n")
"""


def configure(limits: SandboxLimits) -> None:
    """Install this worker's sandbox limits (from RewardConfig) for all later calls."""
    global _limits
    _limits = limits


def worker_limits() -> SandboxLimits:
    """This worker's sandbox limits (what `configure` installed), for other sandboxed tasks."""
    return _limits


def extract_program(response: str) -> str:
    """The last fenced code block of `response` (an unclosed final fence runs to the end), else
    the whole response."""
    blocks = _FENCE_RE.findall(response)
    return blocks[-1] if blocks else response


def _failed_run(run: SandboxRun, what: str) -> RewardResult | None:
    """The result for a run that did not complete normally, or None if it did."""
    if not run.started:
        return RewardResult(0.0, RewardStatus.sandbox_error, f"sandbox failed: {run.error}")
    if run.timed_out:
        return RewardResult(0.0, RewardStatus.timeout, f"{what}: time limit")
    if run.output_capped:
        return RewardResult(0.0, RewardStatus.ok, f"{what}: output limit")
    if run.returncode != 0:
        return RewardResult(0.0, RewardStatus.ok, f"{what}: exit status {run.returncode}")
    return None


def loadable_prompt(prompt: str) -> str:
    """`prompt` as a module that compiles: one ending at a signature (`def f(x):`) gets an
    indented `pass` body. Unchanged when it compiles already, or when `pass` does not help."""
    if _compiles(prompt):
        return prompt
    lines = prompt.rstrip().splitlines()
    defs = [line for line in lines if re.match(r"\s*(?:async\s+)?def\s", line)]
    if not lines or not defs or not lines[-1].rstrip().endswith(":"):
        return prompt
    indent = re.match(r"\s*", defs[-1]).group() + "    "
    patched = prompt.rstrip() + "\n" + indent + "pass\n"
    return patched if _compiles(patched) else prompt


def _compiles(source: str) -> bool:
    try:
        compile(source, "prompt.py", "exec")  # compile only: trusted data, nothing runs
    except (SyntaxError, ValueError):
        return False
    return True


@functools.lru_cache(maxsize=4096)
def humaneval_reference_problem(reference: str) -> str:
    """'' if this HumanEval reference can grade at all, else why not (a grader error). Static:
    compiles the prompt and the test, nothing is executed."""
    try:
        spec = json.loads(reference)
        prompt, test, entry_point = spec["prompt"], spec["test"], spec["entry_point"]
    except (ValueError, KeyError, TypeError) as e:
        return f"reference is not JSON with prompt, test, entry_point: {type(e).__name__}: {e}"
    prompt = loadable_prompt(prompt)
    try:
        prompt_tree = ast.parse(prompt)
        test_tree = ast.parse(prompt + "\n" + test)
    except (SyntaxError, ValueError) as e:
        return f"prompt + test do not compile: {type(e).__name__}: {e}"[:200]
    if not _defines(prompt_tree, entry_point):
        return f"prompt defines no entry point {entry_point!r}"
    if not _defines(test_tree, "check"):
        return "test defines no check(candidate)"
    return ""


def check_humaneval_references(references: list[str], source: str) -> None:
    """Data-load check: raise ValueError, naming the rows, when any reference is a grader error
    (every answer to it would score 0 whatever it is)."""
    bad = [(i, why) for i, ref in enumerate(references) if (why := humaneval_reference_problem(ref))]
    if bad:
        first = "; ".join(f"row {i}: {why}" for i, why in bad[:3])
        raise ValueError(
            f"{len(bad)} of {len(references)} HumanEval references in {source} cannot grade any "
            f"answer ({first}): fix or remove them"
        )


def _defines(tree: ast.Module, name: str) -> bool:
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name for node in tree.body
    )


def _humaneval_source(completion: str, prompt: str, test: str, entry_point: str) -> str:
    defines_entry = re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", completion, re.MULTILINE)
    # A whole function goes after the prompt (keeping its imports and helpers) and replaces the
    # prompt's stub; a body continues the prompt's signature.
    stub = loadable_prompt(prompt)
    program = stub + "\n" + completion if defines_entry else prompt + completion
    return _HARNESS + f"\n_areal_harness({program!r}, {stub!r}, {test!r}, {entry_point!r})\n"


def reward_humaneval(response: str, reference: str) -> RewardResult:
    """RewardFn for `humaneval`."""
    problem = humaneval_reference_problem(reference)
    if problem:
        return RewardResult(0.0, RewardStatus.grader_error, problem)
    spec = json.loads(reference)
    completion = extract_program(response)
    if not completion.strip():
        return RewardResult(0.0, RewardStatus.parse_error, "empty completion")
    source = _humaneval_source(completion, spec["prompt"], spec["test"], spec["entry_point"])
    nonce = secrets.token_hex(16).encode()
    run = _run(source, nonce + b"\n")
    if b"G" + nonce in run.stdout.splitlines():
        return RewardResult(0.0, RewardStatus.grader_error, "the test module failed to load")
    failure = _failed_run(run, "tests")
    if failure is not None:
        return failure
    if nonce not in run.stdout.splitlines():
        return RewardResult(0.0, RewardStatus.ok, "tests: check did not complete")
    return RewardResult(1.0, RewardStatus.ok, "passed")


def reward_code_stdio(response: str, reference: str) -> RewardResult:
    """RewardFn for `code_stdio`. Stops at the first failing test case."""
    cases = json.loads(reference)["tests"]
    if not cases:  # every program would pass
        return RewardResult(0.0, RewardStatus.grader_error, "code_stdio reference has no test cases")
    program = extract_program(response)
    if not program.strip():
        return RewardResult(0.0, RewardStatus.parse_error, "empty program")
    for i, case in enumerate(cases, start=1):
        what = f"test {i}/{len(cases)}"
        run = _run(program, case["input"].encode())
        failure = _failed_run(run, what)
        if failure is not None:
            return failure
        if _output_lines(run.stdout) != _output_lines(case["output"].encode()):
            return RewardResult(0.0, RewardStatus.ok, f"{what}: wrong answer")
    return RewardResult(1.0, RewardStatus.ok, f"passed {len(cases)} tests")


def _run(source: str, stdin: bytes) -> SandboxRun:
    return run_program({"main.py": source}, stdin, _limits)


def _output_lines(data: bytes) -> list[str]:
    lines = [line.rstrip() for line in data.decode("utf-8", errors="replace").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines
