"""A user's own reward function (reward.function, reward/user_fn.py): both specs, both signatures,
what it may return, and each bad input with the message the user sees. In-process; the worker
processes and the sandbox are in tests/integration/reward/test_reward_user_fn_service.py."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest

from areal_jobs.api import UNSCORED_STATUSES, RewardResult, RewardStatus
from areal_jobs.reward import registry
from areal_jobs.reward.user_fn import (
    Signature,
    UserFunctionError,
    load,
    module_name_for,
    parse_spec,
    to_result,
)
from areal_jobs.reward.user_fn_sandbox import score_in_worker, static_signature

VERL = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == ground_truth), "source_len": len(data_source),
            "split_is_train": float(extra_info["split"] == "train"), "note": "not a number"}
"""
OURS = """
def reward(response, reference):
    return response.strip() == reference
"""


def write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def test_specs_parse_as_a_file_a_default_name_or_a_module() -> None:
    assert parse_spec("dir/rewards.py:compute_score") == parse_spec("dir/rewards.py")
    assert parse_spec("dir/rewards.py").is_file and parse_spec("dir/rewards.py").name == "compute_score"
    spec = parse_spec("my_pkg.rewards:score")
    assert (spec.location, spec.name, spec.is_file) == ("my_pkg.rewards", "score", False)
    with pytest.raises(UserFunctionError, match=r"reward.function='my pkg:score'.*neither a .py file"):
        parse_spec("my pkg:score")
    with pytest.raises(UserFunctionError, match="expected path/to/rewards.py:compute_score"):
        parse_spec("rewards.py:not-a-name")


def test_the_registry_keeps_builtin_names_and_accepts_specs() -> None:
    assert registry.target("gsm8k") == "areal_jobs.reward.math_answer:reward_math"
    assert registry.target("dir/r.py") == "dir/r.py:compute_score"
    assert registry.has_checker("dir/r.py:f") and registry.has_checker("math")
    with pytest.raises(ValueError, match=r"unknown reward task 'gsm9k'.*path/to/rewards.py:compute_score"):
        registry.target("gsm9k")


def test_verl_signature_gets_keywords_and_extra_info_as_a_dict(tmp_path: Path) -> None:
    path = write(tmp_path, "verl_rewards.py", VERL)
    fn = registry.resolve_user(f"{path}:compute_score")
    assert fn.signature is Signature.verl_keywords
    result = fn(" 42", "42", "openai/gsm8k", json.dumps({"split": "train", "index": 3}))
    assert result.reward == 1.0 and result.status is RewardStatus.ok
    # the other numeric keys are its metrics; a string is not one
    assert dict(result.metrics) == {"source_len": 12.0, "split_is_train": 1.0}
    with pytest.raises(KeyError):  # its own bug surfaces as its exception (the worker turns it into fn_error)
        fn("41", "42", "x", "{}")


def test_our_signature_and_a_module_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "my_rewards_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write(package, "scoring.py", OURS)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = registry.resolve("my_rewards_pkg.scoring:reward")  # (response, reference): the built-ins' shape
    assert fn.signature is Signature.ours
    assert fn("7", "7") == RewardResult(1.0)
    assert fn(" 8", "7").reward == 0.0


def test_four_positional_parameters_with_other_names_are_verl_order(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "pos.py",
        "def f(src, text, gold, info):\n    return len(src) + (text == gold) + len(info)\n",
    )
    fn = load(f"{path}:f")
    assert fn.signature is Signature.verl_positional
    assert fn("a", "a", "ab", '{"k": 1}').reward == 4.0


def test_two_files_of_the_same_name_are_two_modules(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = write(tmp_path / "a", "rewards.py", "def f(r, g):\n    return 1\n")
    two = write(tmp_path / "b", "rewards.py", "def f(r, g):\n    return 0\n")
    assert module_name_for(one.resolve()) != module_name_for(two.resolve())
    assert load(f"{one}:f")("x", "y").reward == 1.0
    assert load(f"{two}:f")("x", "y").reward == 0.0
    assert "rewards" not in sys.modules  # never shadows (nor is shadowed by) a module `rewards`


@pytest.mark.parametrize(
    ("value", "reward", "status", "detail"),
    [
        (0.5, 0.5, RewardStatus.ok, ""),
        (1, 1.0, RewardStatus.ok, ""),
        (True, 1.0, RewardStatus.ok, ""),
        ({"score": 0.25, "acc": 1}, 0.25, RewardStatus.ok, ""),
        (
            RewardResult(0.0, RewardStatus.parse_error, "no answer"),
            0.0,
            RewardStatus.parse_error,
            "no answer",
        ),
        (math.nan, 0.0, RewardStatus.fn_invalid, "f returned nan, not a finite number"),
        (math.inf, 0.0, RewardStatus.fn_invalid, "f returned inf, not a finite number"),
        ("1.0", 0.0, RewardStatus.fn_invalid, "f returned str '1.0', not a number"),
        (None, 0.0, RewardStatus.fn_invalid, "f returned NoneType None, not a number"),
        ({"acc": 1.0}, 0.0, RewardStatus.fn_invalid, "f returned a dict without 'score' (keys ['acc'])"),
        ({"score": "high"}, 0.0, RewardStatus.fn_invalid, "f returned str 'high', not a number"),
    ],
)
def test_what_comes_back(value: object, reward: float, status: RewardStatus, detail: str) -> None:
    result = to_result(value, "f")
    assert (result.reward, result.status, result.detail) == (reward, status, detail)


def test_failed_statuses_leave_the_sample_out_of_training() -> None:
    for status in (RewardStatus.fn_error, RewardStatus.fn_timeout, RewardStatus.fn_invalid):
        assert status.value in UNSCORED_STATUSES
    assert (
        RewardStatus.ok.value not in UNSCORED_STATUSES and RewardStatus.timeout.value not in UNSCORED_STATUSES
    )


# ---------------------------------------------------------------- bad inputs: the messages


def test_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserFunctionError, match=r"^reward.function=.*nope.py:compute_score: no file "):
        load(f"{tmp_path}/nope.py")


def test_a_file_that_does_not_import(tmp_path: Path) -> None:
    broken = write(tmp_path, "broken.py", "def compute_score(a, b):\n    return 1\nimport not_a_module_xyz\n")
    with pytest.raises(
        UserFunctionError,
        match=r"reward.function=.*broken.py:compute_score: .*broken.py does not import: "
        r"ModuleNotFoundError: No module named 'not_a_module_xyz'",
    ):
        load(str(broken))
    syntax = write(tmp_path, "syntax.py", "def compute_score(a, b)\n    return 1\n")
    with pytest.raises(UserFunctionError, match=r"syntax.py does not import: SyntaxError"):
        load(str(syntax))


def test_a_missing_function_names_the_ones_there(tmp_path: Path) -> None:
    path = write(tmp_path, "some.py", OURS)
    with pytest.raises(
        UserFunctionError, match=r"some.py has no function 'compute_score' \(it defines \['reward'\]\)"
    ):
        load(str(path))


@pytest.mark.parametrize(
    ("source", "why"),
    [
        (
            "def compute_score(a, b, c):\n    return 1\n",
            r"compute_score\(a, b, c\): cannot be called with 2 or 4",
        ),
        (
            "def compute_score():\n    return 1\n",
            r"compute_score\(\): cannot be called with 2 or 4 arguments",
        ),
        (
            "def compute_score(data_source, solution_str, answer):\n    return 1\n",
            r"parameters \['answer'\] are not verl's",
        ),
        ("def compute_score(a, b, *, key):\n    return 1\n", "required keyword-only parameters"),
        ("compute_score = 3\n", "'compute_score' is a int, not a function"),
    ],
)
def test_a_wrong_signature(tmp_path: Path, source: str, why: str) -> None:
    path = write(tmp_path, "sig.py", source)
    with pytest.raises(UserFunctionError, match=why) as err:
        load(str(path))
    if "not a function" not in why:
        assert "expected ours, (response, reference), or verl's, (data_source, solution_str" in str(err.value)


def test_the_worker_turns_a_raise_into_fn_error_with_its_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, "raises.py", "def compute_score(response, reference):\n    return 1 / 0\n")
    result, trace = score_in_worker(str(path), "r", "g", "", "{}")
    assert result.status is RewardStatus.fn_error
    assert result.detail == f"reward.function={path} raised ZeroDivisionError: division by zero"
    assert "Traceback" in trace and "return 1 / 0" in trace
    result, trace = score_in_worker(f"{tmp_path}/missing.py", "r", "g", "", "{}")
    assert result.status is RewardStatus.fn_error and "no file" in result.detail


def test_the_sandbox_check_reads_the_signature_without_running_the_file(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = write(
        tmp_path,
        "untrusted.py",
        f"open({str(marker)!r}, 'w').write('x')\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=print('ran')):\n    return 1\n",
    )
    assert static_signature(str(path)) == (
        Signature.verl_keywords,
        ("data_source", "solution_str", "ground_truth", "extra_info"),
    )
    assert not marker.exists()
    bad = write(tmp_path, "bad_sig.py", "def compute_score(a, b, c):\n    return 1\n")
    with pytest.raises(UserFunctionError, match=r"cannot be called with 2 or 4 arguments"):
        static_signature(str(bad))
    with pytest.raises(UserFunctionError, match=r"has no top-level `def score\(...\)`"):
        static_signature(f"{path}:score")
    with pytest.raises(UserFunctionError, match="function_isolation=sandbox runs one file"):
        static_signature("some.module:fn")
