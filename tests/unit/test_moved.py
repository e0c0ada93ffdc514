"""Former module names (issue 45's move into rooms) keep working for a release, with a warning
that names the new one: imports, `from pkg import mod`, and `python -m old.name`."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from areal_jobs import moved

REPO = Path(__file__).resolve().parents[2]


def test_every_former_name_points_at_a_module_that_exists_and_no_file_answers_it():
    assert len(moved.MOVED) > 50
    for old, new in moved.MOVED.items():
        old_file = REPO.joinpath(*old.split(".")).with_suffix(".py")
        new_file = REPO.joinpath(*new.split(".")).with_suffix(".py")
        assert not old_file.exists(), f"{old_file} exists again: drop {old} from areal_jobs/moved.py"
        assert new_file.is_file(), f"{old} -> {new}: {new_file} does not exist"


def test_a_former_name_imports_the_new_module_itself_with_a_warning_naming_it():
    new = importlib.import_module("areal_jobs.staleness")
    sys.modules.pop("areal_jobs.data.staleness", None)
    with pytest.warns(FutureWarning, match=r"areal_jobs\.data\.staleness moved to areal_jobs\.staleness"):
        old = importlib.import_module("areal_jobs.data.staleness")
    assert old is new
    sys.modules.pop("bench.ablation_table", None)
    with pytest.warns(FutureWarning, match=r"bench\.staleness\.ablation_table"):
        from bench import ablation_table  # noqa: F401 - the `from pkg import mod` form
    assert sys.modules["bench.ablation_table"] is importlib.import_module("bench.staleness.ablation_table")


def test_the_finder_answers_only_its_table():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("bench.no_such_bench")
        assert importlib.util.find_spec("areal_jobs.data.prompts").origin.endswith(
            "areal_jobs/data/prompts.py"
        )


@pytest.mark.parametrize("name", ["bench.ablate", "bench.staleness.ablate", "bench.gpu_trainer"])
def test_python_dash_m_runs_old_and_new_names(name):
    out = subprocess.run(
        [sys.executable, "-m", name, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout
    if name in moved.MOVED:
        assert f"{name} moved to {moved.MOVED[name]}" in out.stderr
