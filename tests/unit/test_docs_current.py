"""The docs stay true: every command, override, path and name that README.md, docs/ and
bench/**/README.md show exists in the repository (tests/docs_check says how each is checked).
Pure and fast (no subprocess); a failure names the doc, the line and what to change."""

from __future__ import annotations

from docs_check.checks import (
    DEV_PATH_RE,
    FILE_NAME_RE,
    PLACEHOLDER_RE,
    check_make,
    check_module_args,
    check_names,
    check_path,
    check_test_names,
    findings,
)
from docs_check.overrides import check_override


def report(kind: str, what: str) -> None:
    found = findings(kind)
    assert not found, f"{len(found)} {what} in the docs that the repository does not have:\n" + "\n".join(
        found
    )


# ------------------------------------------------------------------------------------ the tests
def test_make_targets_and_variables_exist() -> None:
    report("make", "`make` targets, variables or options")


def test_python_modules_and_their_options_exist() -> None:
    report("python", "`python -m` modules or options")


def test_hydra_overrides_name_real_keys_and_choices() -> None:
    report("override", "Hydra overrides")


def test_repository_paths_exist() -> None:
    report("path", "repository paths")


def test_module_and_class_names_exist() -> None:
    report("names", "module or class names")


def test_the_checks_catch_what_they_are_for() -> None:
    """Each check refuses a stale example of its kind, so a check that stopped working fails here."""
    assert check_make(["nosuch-target"]) and check_make(["run", "NO_SUCH_VAR=1"])
    assert check_make(["ablate", "OVERRIDES=--etas 4 --seeds 1"])  # the bench/README.md of issue 45
    assert not check_make(["ablate", "ABLATE=pilot", "OVERRIDES=--budget-h 3"])
    assert check_make(["run", "EXP=nosuch"]) and check_make(["eval", "EVAL_ARGS=--nosuch"])
    assert check_make(["submit", "OVERRIDES=cluster.nosuch=1"]) and not check_make(["run", "EXP=countdown"])
    assert check_module_args("bench.staleness.ablate", ["run", "--etas", "4"])
    assert check_module_args("launch.nosuch", [])
    assert check_module_args("launch.local", ["algo.nosuch=1"]) and check_module_args(
        "launch.local", ["--etas"]
    )
    assert check_override("algo=nosuch") and check_override("rollout/engine=nosuch")
    assert check_override("rollout.pause_mode=nosuch") and not check_override("rollout/engine=vllm")
    assert check_path("docs/nosuch.md") and check_path("../shared/reference/x.md")
    assert check_path("launch/planning/fit/memory.NoSuchClass") and check_path("rollout/nosuch.py")
    assert (
        not check_path("runs/<name>/final_hf")
        and not check_path("docs/")
        and not check_path("../README.md", "docs")
    )
    assert DEV_PATH_RE.search("--run-root /work/notes/ablate/runs") and not DEV_PATH_RE.search("/tmp/out")
    assert (
        FILE_NAME_RE.search("(`torch_backend.py`)")
        and FILE_NAME_RE.search("This refines DESIGN.md §7")
        and PLACEHOLDER_RE.match("BENCH")
    )
    assert check_path("reference/engines-cpu.md") and not check_path("srt/arg_groups/memory_hook.py")
    assert check_names("VLLM_INSTALL") and check_names("MegatronBackend._broadcast_batch")
    assert check_names("sglang_client.NoSuchClient") and not check_names("sglang_client.SGLangClient")
    assert check_test_names("`test_no_such_test[default]`") and not check_test_names(
        "test_the_checks_catch_..."
    )
    assert check_names("areal_jobs.config.no_such_function") and check_names("areal_jobs.nosuchmodule")
