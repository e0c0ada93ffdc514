"""submitit auxiliary jobs (launch/slurm/aux_jobs.py) on the local SLURM cluster: a command runs on a
fake GPU node with the run's cluster settings, and its state is watched to the end, including a
job that dies without a result (cancelled), which submitit sees only through sacct."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from local_slurm import LocalSlurm

from areal_jobs.config import (
    ClusterConfig,
    ClusterKind,
    JobConfig,
    RunConfig,
    save_job_config,
)
from launch.slurm.aux_jobs import submit_command, watch

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[3]


def local_cluster(tmp_path: Path) -> ClusterConfig:
    return ClusterConfig(
        kind=ClusterKind.slurm, nodes=4, gpus_per_node=1, cpus_per_task=1, workdir=str(tmp_path)
    )


def test_command_runs_on_a_gpu_node_and_reports_completion(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    probe = "import os; print('aux on', os.environ['SLURMD_NODENAME'], os.environ['CUDA_VISIBLE_DEVICES'], os.getcwd())"
    job = submit_command(
        local_cluster(tmp_path),
        tmp_path / "aux",
        [sys.executable, "-c", probe],
        name="probe",
        gpus_per_node=1,
    )
    states: list[str] = []
    assert watch(job, poll_s=0.5, report=states.append, timeout_s=300).startswith("COMPLETED")
    assert states[-1].endswith("COMPLETED")
    node, gpus, cwd = job.result().split()[2:]
    assert node.startswith("n") and gpus == "0" and cwd == str(tmp_path)


def test_a_cancelled_job_is_reported_not_waited_on_forever(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    job = submit_command(local_cluster(tmp_path), tmp_path / "aux", ["sleep", "600"], name="sleeper")
    deadline = time.monotonic() + 60
    while slurm_cluster.job_states(job.job_id) != ["RUNNING"]:
        assert time.monotonic() < deadline, slurm_cluster.job_states(job.job_id)
        time.sleep(0.2)
    slurm_cluster.run("scancel", job.job_id)
    assert watch(job, poll_s=0.5, report=lambda _: None, timeout_s=300).startswith("CANCELLED")


def test_cli_uses_the_run_config_and_waits(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    save_job_config(
        JobConfig(run=RunConfig(name="run", root=str(tmp_path)), cluster=local_cluster(tmp_path)),
        run_dir / "config.yaml",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "launch.slurm.aux_jobs", "--run-dir", str(run_dir), "--gpus", "1", "--wait", "--",
         "echo", "converted"],
        cwd=REPO, env=slurm_cluster.env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "submitted job" in proc.stdout and "COMPLETED" in proc.stdout and "converted" in proc.stdout
