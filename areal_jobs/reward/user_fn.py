"""A user's own reward function (`reward.function=path/to/rewards.py:compute_score`, or
`package.module:fn`): loading it, telling its signature, and turning what it returns into a
RewardResult.

Two signatures work, told apart once, when the function is loaded (`Signature`):
- ours, `fn(response, reference)`, as the built-in verifiers (api.RewardFn);
- verl's, `compute_score(data_source, solution_str, ground_truth, extra_info)`: called with those
  keywords (verl does the same), `extra_info` as a dict (the row's other fields). A function that
  names none of them but takes four positional parameters is called positionally in verl's order.
It may return a number (float, int, bool), a dict with `score` (its other numeric keys become
RewardResult.metrics, logged as reward/fn/<key>), or a RewardResult. NaN, inf, None, a string, a
dict without a numeric `score`: RewardStatus.fn_invalid, never a silent 0.

A file is imported with importlib under a module name unique to its absolute path (a user's
`rewards.py` never shadows, nor is shadowed by, another module of that name), once per process.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from areal_jobs.api import RewardResult, RewardStatus

DEFAULT_FUNCTION = "compute_score"  # verl's custom_reward_function.name default
VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class UserFunctionError(ValueError):
    """The function cannot be used; the message names reward.function and what to change."""


class Signature(enum.Enum):
    ours = "ours"  # fn(response, reference)
    verl_keywords = "verl_keywords"  # fn(data_source=, solution_str=, ground_truth=, extra_info=)
    verl_positional = "verl_positional"  # fn(a, b, c, d) in verl's order


def is_function_spec(task: str) -> bool:
    """A user function spec rather than a built-in task name: `file.py[:fn]` or `module:fn`."""
    return ":" in task or task.endswith(".py")


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    location: str  # a file path (is_file) or a dotted module name
    name: str  # the function's name in it
    is_file: bool

    @property
    def text(self) -> str:
        return f"{self.location}:{self.name}"


def parse_spec(spec: str, key: str = "reward.function") -> FunctionSpec:
    """`path/to/file.py:fn`, `path/to/file.py` (fn = compute_score) or `package.module:fn`."""
    location, sep, name = spec.rpartition(":")
    if not sep:
        location, name = spec, DEFAULT_FUNCTION
    if not location or not name.isidentifier():
        raise UserFunctionError(
            f"{key}={spec!r}: expected path/to/rewards.py:compute_score or package.module:function"
        )
    is_file = location.endswith(".py") or "/" in location
    if not is_file and not _MODULE_RE.match(location):
        raise UserFunctionError(
            f"{key}={spec!r}: {location!r} is neither a .py file nor a dotted module name"
        )
    return FunctionSpec(location, name, is_file)


def module_name_for(path: Path) -> str:
    """A module name of its own for the file at `path` (absolute): never another module's."""
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    return f"areal_user_reward_{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}_{digest}"


def _import(spec: FunctionSpec, key: str, keep: bool = True) -> object:
    if not spec.is_file:
        try:
            return importlib.import_module(spec.location)
        except Exception as e:  # noqa: BLE001  any error of the user's module is a config error
            raise UserFunctionError(
                f"{key}={spec.text}: cannot import module {spec.location}: {type(e).__name__}: {e}"
            ) from e
    path = Path(spec.location).resolve()
    if not path.is_file():
        raise UserFunctionError(f"{key}={spec.text}: no file {path}")
    name = module_name_for(path)
    if keep and name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserFunctionError(f"{key}={spec.text}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up while it executes
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # SyntaxError, ImportError, sys.exit(): it does not import
        sys.modules.pop(name, None)
        raise UserFunctionError(f"{key}={spec.text}: {path} does not import: {type(e).__name__}: {e}") from e
    finally:
        if not keep:
            sys.modules.pop(name, None)
    return module


def signature_of(fn: Callable, what: str) -> Signature:
    """Which of the two signatures `fn` has; UserFunctionError (naming `what`) for neither."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:
        raise UserFunctionError(f"{what}: its signature cannot be read ({e})") from e
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    var_positional = any(p.kind is p.VAR_POSITIONAL for p in params)
    shown = f"({', '.join(str(p) for p in params)})"
    expected = (
        "expected ours, (response, reference), or verl's, "
        "(data_source, solution_str, ground_truth, extra_info=None)"
    )
    if {p.name for p in params} & set(VERL_PARAMS):
        extra = [p.name for p in required if p.name not in VERL_PARAMS]
        if extra or any(p.kind is p.POSITIONAL_ONLY for p in required):
            raise UserFunctionError(
                f"{what}{shown}: parameters {extra or 'positional-only'} are not verl's; {expected}"
            )
        return Signature.verl_keywords
    if any(p.kind is p.KEYWORD_ONLY for p in required):
        raise UserFunctionError(f"{what}{shown}: required keyword-only parameters; {expected}")

    def fits(n: int) -> bool:
        return len(required) <= n and (len(positional) >= n or var_positional)

    if fits(2):
        return Signature.ours
    if fits(4):
        return Signature.verl_positional
    raise UserFunctionError(f"{what}{shown}: cannot be called with 2 or 4 arguments; {expected}")


@dataclass(frozen=True)
class UserFunction:
    """A loaded user function and how to call it. Calling it may raise whatever the function raises."""

    spec: FunctionSpec
    fn: Callable
    signature: Signature

    def __call__(
        self, response: str, reference: str, data_source: str = "", extra_info: str = "{}"
    ) -> RewardResult:
        if self.signature is Signature.ours:
            value = self.fn(response, reference)
        else:
            info = json.loads(extra_info or "{}")
            args = (data_source, response, reference, info if isinstance(info, dict) else {})
            if self.signature is Signature.verl_positional:
                value = self.fn(*args)
            else:
                value = self.fn(**_accepted(self.fn, dict(zip(VERL_PARAMS, args))))
        return to_result(value, self.spec.name)


def _accepted(fn: Callable, kwargs: dict) -> dict:
    """The keywords `fn` takes (all of them with **kwargs): `extra_info` is optional in verl."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def to_result(value: object, name: str = "reward function") -> RewardResult:
    """What the function returned, as a RewardResult; fn_invalid (with what came back) otherwise."""
    if isinstance(value, RewardResult):
        if not math.isfinite(value.reward):
            return RewardResult(
                0.0, RewardStatus.fn_invalid, f"{name} returned a RewardResult with reward {value.reward}"
            )
        return value
    metrics: tuple[tuple[str, float], ...] = ()
    if isinstance(value, dict):
        if "score" not in value:
            return RewardResult(
                0.0,
                RewardStatus.fn_invalid,
                f"{name} returned a dict without 'score' (keys {sorted(map(str, value))[:8]})",
            )
        metrics = tuple(
            (str(k), float(v))
            for k, v in value.items()
            if k != "score" and _is_number(v) and math.isfinite(float(v))
        )
        value = value["score"]
    if not _is_number(value):
        return RewardResult(
            0.0,
            RewardStatus.fn_invalid,
            f"{name} returned {type(value).__name__} {_short(value)}, not a number",
        )
    score = float(value)
    if not math.isfinite(score):
        return RewardResult(0.0, RewardStatus.fn_invalid, f"{name} returned {score}, not a finite number")
    return RewardResult(score, RewardStatus.ok, metrics=metrics)


def _is_number(value: object) -> bool:
    """int, float, bool, and numpy/torch scalars (they define __float__ and are not strings)."""
    if isinstance(value, (bool, int, float)):
        return True
    return (
        hasattr(value, "__float__") and not isinstance(value, (str, bytes)) and getattr(value, "ndim", 0) == 0
    )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@functools.cache
def load(spec_text: str, key: str = "reward.function") -> UserFunction:
    """Import the function named by `spec_text` and tell its signature (cached per process)."""
    return _load(spec_text, key, keep=True)


def check(spec_text: str, key: str = "reward.function") -> Signature:
    """The launcher's check: import the file as it is now, find the function, tell its signature;
    nothing is cached, nothing stays in sys.modules (UserFunctionError naming `key` otherwise)."""
    return _load(spec_text, key, keep=False).signature


def _load(spec_text: str, key: str, keep: bool) -> UserFunction:
    spec = parse_spec(spec_text, key)
    module = _import(spec, key, keep)
    fn = getattr(module, spec.name, None)
    if fn is None:
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise UserFunctionError(
            f"{key}={spec.text}: {spec.location} has no function {spec.name!r} (it defines {found[:10]})"
        )
    if not callable(fn):
        raise UserFunctionError(f"{key}={spec.text}: {spec.name!r} is a {type(fn).__name__}, not a function")
    return UserFunction(spec, fn, signature_of(fn, f"{key}={spec.text}: {spec.name}"))
