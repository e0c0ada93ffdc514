"""A user's reward function inside a reward worker (`score_in_worker`), and under
`reward.function_isolation=sandbox` run in the code sandbox, for code a cluster admin does not trust.

Nothing of the user's file runs in our processes. Its signature is read from its syntax tree
(`static_signature`: the `def` with its defaults blanked is compiled alone and inspected), and
each call runs the file in a fresh sandboxed interpreter (sandbox.run_program: namespaces, rlimits,
`python -I -S`, so the standard library only) beside a small runner (`_RUNNER`) that reads the
arguments as JSON on stdin, calls the function, and writes what it returned as JSON on the line
after a per-call nonce (the function's own prints go to stderr). A call that runs past
reward.code_wall_timeout_s is a fn_timeout; one that raises is a fn_error with its traceback.
"""

from __future__ import annotations

import ast
import functools
import json
import secrets
from pathlib import Path

from areal_jobs.api import RewardResult, RewardStatus
from areal_jobs.reward.sandbox import SandboxLimits, run_program
from areal_jobs.reward.user_fn import Signature, UserFunctionError, load, parse_spec, signature_of, to_result

_MAX_TRACEBACK_CHARS = 4000

_RUNNER = r"""
import json, os, sys, traceback
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's dir out
request = json.loads(sys.stdin.read())
nonce = request["nonce"]
real_stdout, sys.stdout = sys.stdout, sys.stderr  # the function's prints never fake a result line
def emit(obj):
    real_stdout.write("\n" + nonce + "\n" + json.dumps(obj) + "\n")
    real_stdout.flush()
def plain(value):
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict):
        out = {str(k): plain(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if isinstance(v, float) or k == "score"}
    if hasattr(value, "__float__") and not isinstance(value, (str, bytes)):
        return float(value)
    return {"__invalid__": type(value).__name__ + " " + repr(value)[:60]}
try:
    import user_reward
    fn = getattr(user_reward, request["name"])
    a = request["args"]
    if request["signature"] == "ours":
        value = fn(a["solution_str"], a["ground_truth"])
    elif request["signature"] == "verl_positional":
        value = fn(a["data_source"], a["solution_str"], a["ground_truth"], a["extra_info"])
    else:
        value = fn(**{k: v for k, v in a.items() if k in request["keywords"]})
    emit({"value": plain(value)})
except BaseException as e:
    emit({"error": type(e).__name__ + ": " + str(e)[:300], "traceback": traceback.format_exc()[-4000:]})
"""


@functools.cache
def static_signature(spec_text: str, key: str = "reward.function") -> tuple[Signature, tuple[str, ...]]:
    """The function's signature and the verl keywords it takes, read without running the file."""
    spec = parse_spec(spec_text, key)
    if not spec.is_file:
        raise UserFunctionError(
            f"{key}={spec.text}: reward.function_isolation=sandbox runs one file in the sandbox: "
            "name it as path/to/rewards.py:function"
        )
    path = Path(spec.location)
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except OSError as e:
        raise UserFunctionError(f"{key}={spec.text}: cannot read {path}: {e}") from e
    except SyntaxError as e:
        raise UserFunctionError(f"{key}={spec.text}: {path} does not import: SyntaxError: {e}") from e
    defs = [
        n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == spec.name
    ]
    if not defs:
        found = sorted(
            n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
        )
        raise UserFunctionError(
            f"{key}={spec.text}: {path} has no top-level `def {spec.name}(...)` (it defines {found[:10]})"
        )
    node = defs[-1]  # the last definition wins, as when the file runs
    args = node.args
    args.defaults = [ast.Constant(None) for _ in args.defaults]
    args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if a is not None:
            a.annotation = None
    stub = ast.Module([ast.FunctionDef(name=spec.name, args=args, body=[ast.Pass()], decorator_list=[])], [])
    namespace: dict = {}
    exec(compile(ast.fix_missing_locations(stub), str(path), "exec"), namespace)  # a bare stub: no user code
    fn = namespace[spec.name]
    signature = signature_of(fn, f"{key}={spec.text}: {spec.name}")
    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    keywords = ("data_source", "solution_str", "ground_truth", "extra_info")
    taken = keywords if args.kwarg is not None else tuple(k for k in keywords if k in names)
    return signature, taken


def run_sandboxed(
    spec_text: str, response: str, reference: str, data_source: str, extra_info: str, limits: SandboxLimits
) -> tuple[RewardResult, str]:
    """One call in the sandbox: (result, traceback text or "")."""
    spec = parse_spec(spec_text)
    signature, keywords = static_signature(spec_text)
    info = json.loads(extra_info or "{}")
    nonce = secrets.token_hex(16)
    request = {
        "nonce": nonce,
        "name": spec.name,
        "signature": signature.value,
        "keywords": list(keywords),
        "args": {
            "data_source": data_source,
            "solution_str": response,
            "ground_truth": reference,
            "extra_info": info if isinstance(info, dict) else {},
        },
    }
    source = Path(spec.location).read_text()
    run = run_program({"main.py": _RUNNER, "user_reward.py": source}, json.dumps(request).encode(), limits)
    where = f"reward.function={spec.text} (sandbox)"
    if not run.started:
        return RewardResult(0.0, RewardStatus.sandbox_error, f"sandbox failed: {run.error}"), ""
    if run.timed_out:
        return RewardResult(
            0.0,
            RewardStatus.fn_timeout,
            f"{where} exceeded reward.code_wall_timeout_s={limits.wall_timeout_s:g}",
        ), ""
    lines = run.stdout.decode(errors="replace").splitlines()
    if nonce not in lines or lines.index(nonce) + 1 >= len(lines):
        stderr = run.stderr.decode(errors="replace")[-_MAX_TRACEBACK_CHARS:]
        why = "output limit" if run.output_capped else f"exit status {run.returncode}"
        return RewardResult(0.0, RewardStatus.fn_error, f"{where} gave no result ({why})"), stderr
    reply = json.loads(lines[lines.index(nonce) + 1])
    if "error" in reply:
        return RewardResult(0.0, RewardStatus.fn_error, f"{where} raised {reply['error']}"), reply[
            "traceback"
        ]
    value = reply["value"]
    if isinstance(value, dict) and "__invalid__" in value:
        return RewardResult(
            0.0, RewardStatus.fn_invalid, f"{spec.name} returned {value['__invalid__']}, not a number"
        ), ""
    return to_result(value, spec.name), ""


def score_in_worker(
    task: str,
    response: str,
    reference: str,
    data_source: str,
    extra_info: str,
    sandbox_limits=None,  # noqa: ANN001
) -> tuple[RewardResult, str]:
    """One call of a user function inside a reward worker: (result, traceback text or "").
    Never raises: a function that cannot be loaded or that raises is a fn_error, with the
    traceback for the service to log (the first one). `sandbox_limits`: run it in the sandbox."""
    import traceback

    if sandbox_limits is not None:
        try:
            return run_sandboxed(task, response, reference, data_source, extra_info, sandbox_limits)
        except UserFunctionError as e:
            return RewardResult(0.0, RewardStatus.fn_error, str(e)), ""
    try:
        fn = load(task)
    except UserFunctionError as e:
        return RewardResult(0.0, RewardStatus.fn_error, str(e)), traceback.format_exc()
    try:
        return fn(response, reference, data_source, extra_info), ""
    except Exception as e:  # noqa: BLE001  the user's bug fails this reward, never the worker
        return (
            RewardResult(
                0.0, RewardStatus.fn_error, f"reward.function={task} raised {type(e).__name__}: {e}"
            ),
            traceback.format_exc(),
        )
