"""A user's reward function at launch (launch/planning/reward_files.py): checked before any server
starts, with the message naming reward.function; copied into the run directory with its sha256;
named in the rendered sbatch script (a recipe composed as `make submit` does)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from areal_jobs.config import (
    FunctionIsolation,
    JobConfig,
    RewardConfig,
    RunConfig,
    register_configs,
    to_job_config,
)
from launch.planning import reward_files
from launch.slurm.submit import prepare, submit

REPO = Path(__file__).resolve().parents[3]
GOOD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"


def job_with(spec: str, isolation: FunctionIsolation = FunctionIsolation.process, **run) -> JobConfig:
    return JobConfig(reward=RewardConfig(function=spec, function_isolation=isolation), run=RunConfig(**run))


@pytest.mark.parametrize("isolation", list(FunctionIsolation))
@pytest.mark.parametrize(
    ("name", "source", "message"),
    [
        ("missing.py", None, r"reward.function=.*missing.py:compute_score: no file "),
        (
            "syntax.py",
            "def compute_score(a, b)\n",
            r"reward.function=.*syntax.py:compute_score: .* does not import: SyntaxError",
        ),
        (
            "nofn.py",
            "def score(a, b):\n    return 1\n",
            r"has no (function 'compute_score'|top-level `def compute_score)",
        ),
        (
            "sig.py",
            "def compute_score(a, b, c):\n    return 1\n",
            r"compute_score\(a, b, c\): cannot be called with 2 or 4",
        ),
    ],
)
def test_a_broken_function_is_refused_naming_the_key(
    tmp_path: Path, isolation: FunctionIsolation, name: str, source: str | None, message: str
) -> None:
    if source is not None:
        (tmp_path / name).write_text(source)
    with pytest.raises(ValueError, match=message):
        reward_files.check_functions(job_with(str(tmp_path / name), isolation))


def test_an_import_error_is_caught_here_in_process_mode_only(tmp_path: Path) -> None:
    """Sandbox mode never runs the untrusted file here: only its syntax and signature are checked."""
    path = tmp_path / "imports.py"
    path.write_text("import not_installed_xyz\n" + GOOD)
    with pytest.raises(ValueError, match="ModuleNotFoundError: No module named 'not_installed_xyz'"):
        reward_files.check_functions(job_with(str(path)))
    assert reward_files.check_functions(job_with(str(path), FunctionIsolation.sandbox)) == []


def test_make_run_refuses_before_anything_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from launch.run import local

    def forbidden(*args, **kwargs):
        raise AssertionError("nothing may be built or started for a broken reward.function")

    for name in ("start_role", "ensure_model", "prepare_run_dir"):
        monkeypatch.setattr(local, name, forbidden)
    (tmp_path / "r.py").write_text("def compute_score(x):\n    return 1\n")
    with pytest.raises(
        SystemExit, match=r"invalid configuration: reward.function=.*r.py:compute_score: compute_score\(x\)"
    ):
        local.launch(job_with(str(tmp_path / "r.py"), root=str(tmp_path / "runs")))
    assert not (tmp_path / "runs").exists()


def test_relative_paths_become_absolute_and_the_copy_keeps_its_sha256(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "rewards.py").write_text(GOOD)
    job = reward_files.absolute_paths(job_with("rewards.py"), tmp_path)
    assert job.reward.function == f"{tmp_path}/rewards.py:compute_score"
    assert reward_files.absolute_paths(job_with("pkg.mod:fn"), tmp_path).reward.function == "pkg.mod:fn"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (row,) = reward_files.record(job, run_dir)
    digest = hashlib.sha256(GOOD.encode()).hexdigest()
    assert row["sha256"] == digest and Path(row["copy"]).read_text() == GOOD
    assert json.loads((run_dir / "reward_functions.json").read_text()) == [row]
    # resumed after an edit: the run says so, and the old copy stays
    (tmp_path / "rewards.py").write_text(GOOD + "# edited\n")
    with caplog.at_level(logging.WARNING):
        reward_files.record(job, run_dir)
    assert "changed since this run last started" in caplog.text
    assert len(list((run_dir / "reward_functions").iterdir())) == 2


def compose_recipe(experiment: str, *overrides: str) -> JobConfig:
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="submit", overrides=[f"experiment={experiment}", *overrides])
    return to_job_config(cfg)


def test_a_recipe_with_a_reward_function_renders_and_submits_it(tmp_path: Path, capsys) -> None:
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "math_rewards.py").write_text(GOOD)
    job = compose_recipe(
        "math_qwen2_7b", "reward.function=rewards/math_rewards.py", f"run.root={tmp_path}/runs"
    )
    prepared = prepare(job, cwd=str(tmp_path), python=sys.executable)
    spec = f"{tmp_path}/rewards/math_rewards.py:compute_score"  # relative to the job's workdir
    assert prepared.job.reward.function == spec
    digest = hashlib.sha256(GOOD.encode()).hexdigest()
    header = prepared.script.splitlines()[:14]
    assert (
        "# Inputs: data.train_path=/path/to/math/train.jsonl data.eval_path=/path/to/math/test.jsonl"
        in header
    )
    assert (
        f"# Reward function: reward.function={spec} (sha256 {digest}, copied to $RUN_DIR/reward_functions/)"
        in header
    )
    submit(prepared, None, dry_run=True)
    assert "data.train_path=/path/to/math/train.jsonl does not exist here" in capsys.readouterr().out
    (row,) = json.loads((prepared.run_dir / "reward_functions.json").read_text())
    assert row["sha256"] == digest and Path(row["copy"]).is_file()
    # on the submitting machine a broken file is refused; one it cannot see is a warning
    (tmp_path / "rewards" / "math_rewards.py").write_text("def compute_score(a):\n    return 1\n")
    with pytest.raises(ValueError, match="reward.function=.*cannot be called with 2 or 4 arguments"):
        submit(prepare(job, cwd=str(tmp_path), python=sys.executable), None, dry_run=True)
    unseen = dataclasses.replace(job, reward=dataclasses.replace(job.reward, function="/nodes/only/r.py"))
    prepared = prepare(unseen, cwd=str(tmp_path), python=sys.executable)
    assert (
        "# Reward function: reward.function=/nodes/only/r.py:compute_score (not visible on the submitting machine)"
        in prepared.script
    )
    submit(prepared, None, dry_run=True)
    assert (
        "reward.function=/nodes/only/r.py:compute_score: no file /nodes/only/r.py here"
        in capsys.readouterr().out
    )


def test_the_mixture_recipe_names_each_source(tmp_path: Path) -> None:
    """conf/experiment/mix_math_code_qwen2_7b.yaml: data.sources comes with issue 43's data half."""
    from areal_jobs.config import DataConfig

    if "sources" not in {f.name for f in dataclasses.fields(DataConfig)}:
        pytest.skip("data.sources is not in this branch's schema yet (the `data` helper's half of issue 43)")
    job = compose_recipe("mix_math_code_qwen2_7b", f"run.root={tmp_path}/runs")
    script = prepare(job, cwd=str(tmp_path), python=sys.executable).script
    inputs = "# Inputs: data.sources.0.path=/path/to/math/train.parquet data.sources.1.path=/path/to/code/train.jsonl"
    assert inputs in script.splitlines()
