"""launch.submit: preparing a job, writing the run dir, the sbatch seam, and the CLI as users
meet it (`--help`, bad overrides, dry run, multirun) with a recording stand-in for sbatch."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from areal_jobs.config import (
    ClusterConfig,
    ClusterKind,
    JobConfig,
    ModelConfig,
    RunConfig,
    load_job_config,
)
from launch.slurm.submit import prepare, submit, sweep_suffix

REPO = Path(__file__).resolve().parents[3]


class RecordingSlurm:
    """The `Slurm` seam, faked: remembers what would have been submitted."""

    def __init__(self) -> None:
        self.scripts: list[Path] = []
        self.envs: list[dict[str, str] | None] = []

    def submit(self, script: Path, env: dict[str, str] | None = None) -> str:
        self.scripts.append(script)
        self.envs.append(env)
        return str(1000 + len(self.scripts))

    def status(self, job_id: str) -> str:
        return "RUNNING"

    def cancel(self, job_id: str) -> None:
        pass


def local_slurm_job(root: Path) -> JobConfig:
    return JobConfig(
        run=RunConfig(name="tiny", root=str(root)),
        model=ModelConfig(path="/models/tiny"),  # an empty path would build the built-in model
        cluster=ClusterConfig(kind=ClusterKind.slurm, nodes=4, gpus_per_node=1, loopback=True),
    )


def test_prepare_fills_submission_defaults_and_plans(tmp_path: Path) -> None:
    job = JobConfig(cluster=ClusterConfig(kind=ClusterKind.slurm, nodes=4, gpus_per_node=1))
    prepared = prepare(job, cwd="/home/me/areal", python="/home/me/venv/bin/python", name_suffix="a=1")
    assert prepared.job.cluster.workdir == "/home/me/areal"
    assert prepared.job.cluster.python == "/home/me/venv/bin/python"
    assert prepared.run_dir == Path("/home/me/areal/runs/tiny-arith/a=1")
    assert prepared.job.rollout.num_servers == 3
    assert prepared.job.model.builtin_dir == "/home/me/areal/areal_jobs/tasks/models/builtin_model"
    assert "#SBATCH --chdir=/home/me/areal" in prepared.script


def test_prepare_refuses_the_local_cluster() -> None:
    with pytest.raises(ValueError, match="cluster=h800 or cluster=local_slurm"):
        prepare(JobConfig(), cwd="/x", python="python")


def test_submit_writes_run_dir_and_calls_sbatch(tmp_path: Path, capsys) -> None:
    slurm = RecordingSlurm()
    prepared = prepare(local_slurm_job(tmp_path), cwd=str(tmp_path), python=sys.executable)
    assert submit(prepared, slurm, dry_run=False) == "1001"
    run_dir = tmp_path / "tiny"
    assert slurm.scripts == [run_dir / "job.sbatch"]
    assert (run_dir / "job.sbatch").read_text() == prepared.script
    assert os.access(run_dir / "job.sbatch", os.X_OK) and (run_dir / "logs").is_dir()
    saved = load_job_config(run_dir / "config.yaml")  # what every role starts from
    assert saved == prepared.job and saved.rollout.num_servers == 3
    assert (run_dir / "jobs.txt").read_text() == "1001\n"
    out = capsys.readouterr().out
    assert "submitted job 1001" in out and "make status JOB=1001" in out and f"tail -F {run_dir}/logs" in out
    # /models/tiny is not on this machine and no model.shape names it: said, not refused
    assert "memory: not checked: no config.json at model.path=/models/tiny and no model.shape" in out


def test_dry_run_writes_but_does_not_submit(tmp_path: Path) -> None:
    slurm = RecordingSlurm()
    prepared = prepare(local_slurm_job(tmp_path), cwd=str(tmp_path), python=sys.executable)
    assert submit(prepared, slurm, dry_run=True) is None
    assert slurm.scripts == [] and (tmp_path / "tiny" / "job.sbatch").exists()


def test_a_finished_run_dir_is_not_reused(tmp_path: Path) -> None:
    slurm = RecordingSlurm()
    prepared = prepare(local_slurm_job(tmp_path), cwd=str(tmp_path), python=sys.executable)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match="run.name="):
        submit(prepared, slurm, dry_run=False)
    assert slurm.scripts == [] and not (tmp_path / "tiny" / "job.sbatch").exists()


def test_sweep_suffix_keeps_only_swept_keys() -> None:
    argv = ["-m", "experiment=math_qwen2_7b", "algo.max_staleness=0,4,8", "cluster.nodes=16"]
    task = ["experiment=math_qwen2_7b", "algo.max_staleness=4", "cluster.nodes=16"]
    assert sweep_suffix(argv, task) == "algo.max_staleness=4"
    assert sweep_suffix(["-m", "x=1"], ["x=1"]) == ""


# ------------------------------------------------------------------ the CLI, as a user runs it


@pytest.fixture
def fake_sbatch(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """PATH with an `sbatch` that records its arguments and prints a job id."""
    bin_dir, record = tmp_path / "bin", tmp_path / "sbatch-calls"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f'#!/bin/sh\necho "$@" >> {record}\necho 4242\n')
    sbatch.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}"), record


def run_submit(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launch.submit", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_help_explains_usage_and_lists_groups(fake_sbatch) -> None:
    env, record = fake_sbatch
    proc = run_submit(env, "--help")
    assert proc.returncode == 0, proc.stderr
    for text in (
        "make submit EXP=NAME",
        "launch.dry_run=true",
        "cluster: h800, local, local_slurm",
        "-m KEY=A,B,C",
    ):
        assert text in proc.stdout
    assert "math_qwen2_1p5b" in proc.stdout and not record.exists()


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("cluster.nodes=banana", ["cluster.nodes", "'banana'", "Integer"]),
        ("cluster.nodez=3", ["cluster.nodez (did you mean cluster.nodes?)"]),
        ("+cluster.nodez=3", ["cluster.nodez (did you mean cluster.nodes?)", "nothing was submitted"]),
        (
            "cluster.placement=colocated",
            ["cluster.placement=colocated", "cluster.nodes=1", "nothing was submitted"],
        ),
        ("cluster.time_limit=forever", ["cluster.time_limit", "nothing was submitted"]),
    ],
)
def test_bad_overrides_fail_clearly_and_submit_nothing(
    fake_sbatch, tmp_path: Path, override, expected
) -> None:
    env, record = fake_sbatch
    proc = run_submit(env, "experiment=math_qwen2_7b", f"run.root={tmp_path}/runs", override)
    assert proc.returncode != 0
    for text in expected:
        assert text in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not record.exists() and not (tmp_path / "runs").exists()


def test_submit_cli_end_to_end(fake_sbatch, tmp_path: Path) -> None:
    env, record = fake_sbatch
    proc = run_submit(env, "experiment=math_qwen2_7b", f"run.root={tmp_path}/runs", "cluster.account=rl")
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / "runs" / "math_qwen2_7b" / "job.sbatch"
    assert record.read_text() == f"--parsable {script}\n"
    assert "submitted job 4242" in proc.stdout and "48 servers of TP 2" in proc.stdout
    assert "#SBATCH --account=rl" in script.read_text()
    # what produced it, for whoever reproduces it
    text = script.read_text()
    assert (
        f"# Command: python -m launch.submit experiment=math_qwen2_7b run.root={tmp_path}/runs cluster.account=rl\n"
        in text
    )
    assert re.search(r"^# Source: git [0-9a-f]{40} ", text, re.M) and "source: git " in proc.stdout


def test_dry_run_cli_renders_without_sbatch(fake_sbatch, tmp_path: Path) -> None:
    env, record = fake_sbatch
    proc = run_submit(env, "experiment=math_qwen2_1p5b", f"run.root={tmp_path}/runs", "launch.dry_run=true")
    assert proc.returncode == 0, proc.stderr
    assert "nothing submitted" in proc.stdout and not record.exists()
    assert (tmp_path / "runs" / "math_qwen2_1p5b" / "job.sbatch").exists()


def test_multirun_submits_one_het_job_per_combination(fake_sbatch, tmp_path: Path) -> None:
    env, record = fake_sbatch
    proc = run_submit(
        env,
        "-m",
        "experiment=math_qwen2_7b",
        f"run.root={tmp_path}/runs",
        "algo.max_staleness=0,8",
        f"hydra.sweep.dir={tmp_path}/multirun",
    )
    assert proc.returncode == 0, proc.stderr
    calls = record.read_text().splitlines()
    assert len(calls) == 2 and proc.stdout.count("submitted job 4242") == 2
    for staleness in (0, 8):
        run_dir = tmp_path / "runs" / "math_qwen2_7b" / f"algo.max_staleness={staleness}"
        assert f"--parsable {run_dir}/job.sbatch" in calls
        assert load_job_config(run_dir / "config.yaml").algo.max_staleness == staleness


# ------------------------------------------------------------------ login-node checks (issue 28)


def test_vllm_renders_only_when_its_interpreter_exists(fake_sbatch, tmp_path: Path) -> None:
    env, record = fake_sbatch
    workdir = tmp_path / "checkout"  # a shared checkout without `make vllm-venv`
    workdir.mkdir()
    args = ("experiment=math_qwen2_1p5b", "rollout/engine=vllm", f"run.root={tmp_path}/runs")
    proc = run_submit(env, *args, f"cluster.workdir={workdir}", "launch.dry_run=true")
    assert proc.returncode == 2
    assert f"needs its interpreter {workdir}/.venv-vllm/bin/python, which does not exist" in proc.stderr
    assert f"run `make vllm-venv` in {workdir}, or set rollout.engine_python=" in proc.stderr
    assert not record.exists() and not (tmp_path / "runs").exists()
    proc = run_submit(env, *args, "rollout.engine_python=/nonexistent/python")
    assert proc.returncode == 2 and "fix rollout.engine_python=/nonexistent/python" in proc.stderr
    venv = workdir / ".venv-vllm" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    proc = run_submit(env, *args, f"cluster.workdir={workdir}")
    assert proc.returncode == 0, proc.stderr
    assert "submitted job 4242" in proc.stdout and "warning: model.path=/path/to/" in proc.stdout


@pytest.mark.parametrize(
    ("cluster", "problem"),
    [
        ({"workdir": "/nonexistent/checkout"}, "cluster.workdir=/nonexistent/checkout is not a directory"),
        (
            {"python": "/nonexistent/bin/python"},
            "cluster.python=/nonexistent/bin/python is not an executable",
        ),
        ({"python": "no-such-python-here"}, "cluster.python=no-such-python-here is not an executable"),
        (
            {"container_image": "/nonexistent/img.sqsh"},
            "cluster.container_image=/nonexistent/img.sqsh does not exist",
        ),
    ],
)
def test_what_the_script_needs_is_checked_on_the_login_node(
    tmp_path: Path, cluster: dict, problem: str
) -> None:
    from launch.slurm.preflight import script_problems

    job = prepare(local_slurm_job(tmp_path), cwd=str(tmp_path), python=sys.executable).job
    assert script_problems(job) == []
    bad = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, **cluster))
    assert any(problem in p for p in script_problems(bad)), script_problems(bad)


def test_inside_a_container_image_only_the_image_is_checked(tmp_path: Path) -> None:
    from launch.slurm.preflight import input_warnings, script_problems

    job = prepare(local_slurm_job(tmp_path), cwd=str(tmp_path), python=sys.executable).job
    image = tmp_path / "img.sqsh"
    image.write_text("")
    for ref in (str(image), "nvcr.io#nvidia/pytorch:25.01-py3"):
        inside = dataclasses.replace(
            job, cluster=dataclasses.replace(job.cluster, container_image=ref, python="/opt/venv/bin/python")
        )
        assert script_problems(inside) == [] and input_warnings(inside) == []


def test_a_sweep_keeps_hydras_record_under_the_runs_root(fake_sbatch, tmp_path: Path) -> None:
    """No `multirun/` in the directory the sweep was started from (issue 28)."""
    env, record = fake_sbatch
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "launch.submit", "-m", "experiment=math_qwen2_7b", f"run.root={tmp_path}/runs"]
        + ["algo.max_staleness=0,8"],
        cwd=cwd,
        env=dict(env, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(record.read_text().splitlines()) == 2
    assert list(cwd.iterdir()) == []
    assert len(list((tmp_path / "runs" / "multirun").glob("*/multirun.yaml"))) == 1
