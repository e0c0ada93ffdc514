"""A satellite job (`launch.scale RUN_DIR +1` on a SLURM run) with stand-in roles (fake_roles.py):
its server registers under a fresh index with the job's key, and it never outlives its run: once
the main job ends, the satellite stops its server by itself. test_slurm_scale.py runs real roles.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import fake_roles
import pytest
import yaml
from local_slurm import LocalSlurm
from test_slurm_hetjob import REPO, submit

pytestmark = pytest.mark.slurm


def test_a_satellite_server_registers_and_ends_with_its_run(
    slurm_cluster: LocalSlurm, tmp_path: Path
) -> None:
    job_id, run_dir = submit(
        slurm_cluster,
        tmp_path,
        "sat",
        "trainer.total_steps=300",
        "cluster.nodes=2",
        "cluster.rollout_fraction=0.5",
    )
    progress = run_dir / "fake" / "progress"
    deadline = time.monotonic() + 120
    while not (progress.exists() and int(progress.read_text()) >= 3):
        assert time.monotonic() < deadline, f"no progress: {slurm_cluster.job_states(job_id)}"
        time.sleep(0.2)

    proc = subprocess.run(
        [sys.executable, "-m", "launch.scale", str(run_dir), "+1"],
        cwd=REPO, env=slurm_cluster.env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert (out["rollout_nodes_before"], out["rollout_nodes"]) == (1, 2)
    [satellite] = out["added"]
    assert satellite["servers"] == [1]  # after the job's server 0
    sat_id = satellite["job_id"]
    assert json.loads((run_dir / "satellites.json").read_text()) == [
        {"job_id": sat_id, "first_index": 1, "num_servers": 1}
    ]
    registration = run_dir / "servers" / "1.json"
    deadline = time.monotonic() + 120
    while not registration.exists():
        assert time.monotonic() < deadline, (
            slurm_cluster.run("scontrol", "show", "job", sat_id).stdout
            + slurm_cluster.run("scontrol", "show", "nodes").stdout
        )
        time.sleep(0.2)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert json.loads(registration.read_text())["port"] == config["rollout"]["base_port"] + 1
    env = json.loads((run_dir / "fake" / "server1.attempt0.json").read_text())
    assert env["AREAL_JOB_TOKEN"] == (run_dir / "job_token").read_text()
    job_nodes = {
        json.loads((run_dir / "fake" / f"{role}.attempt0.json").read_text())["SLURMD_NODENAME"]
        for role in ("server0", "trainer0")
    }
    assert len(job_nodes) == 2 and env["SLURMD_NODENAME"] not in job_nodes  # a node of its own

    fake_roles.hurry(run_dir)  # the main job may end now: its remaining steps run out at once
    assert slurm_cluster.wait_until_done(job_id, timeout_s=180) == ["COMPLETED", "COMPLETED"]
    assert slurm_cluster.wait_until_done(sat_id, timeout_s=120) == ["COMPLETED"]
    sat_log = (run_dir / "logs" / f"satellite-{sat_id}.out").read_text()
    assert f"job {job_id} is over: stopping the servers" in sat_log, sat_log
    assert "server 1 stopped" in (run_dir / "logs" / f"rollout-server-0-sat{sat_id}.log").read_text()
    assert slurm_cluster.leftover_job_processes() == []
