"""The rendered heterogeneous job on a real SLURM cluster, with stand-in roles (fake_roles.py).

Submitted through `python -m launch.submit cluster=local_slurm` exactly as `make submit` does;
only `cluster.python` points at the stand-ins, so these check the sbatch side of the runtime
contract (placement, environment, discovery, token, logs, USR1 -> checkpoint -> requeue -> resume)
in seconds. test_slurm_pipeline.py runs the real roles.
"""

from __future__ import annotations

import json
import re
import secrets
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from local_slurm import LocalSlurm, local_port_overrides

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[3]
FAKE_ROLES = Path(__file__).resolve().parent / "fake_roles.py"


def submit(cluster: LocalSlurm, tmp_path: Path, name: str, *overrides: str) -> tuple[str, Path]:
    wrapper = tmp_path / "fake-python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_ROLES} "$@"\n')
    wrapper.chmod(0o755)
    args = [
        sys.executable,
        "-m",
        "launch.submit",
        "cluster=local_slurm",
        f"cluster.python={wrapper}",
        "model.path=/models/unused-by-fake-roles",  # an empty path would build the built-in model
        f"run.root={tmp_path / 'runs'}",
        f"run.name={name}",
        *local_port_overrides(3),
        *overrides,
    ]
    proc = subprocess.run(
        args, check=False, cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"submitted job (\d+)", proc.stdout)
    assert match, proc.stdout
    return match.group(1), tmp_path / "runs" / name


def _snapshot(run_dir: Path, role: str, attempt: int = 0) -> dict:
    return json.loads((run_dir / "fake" / f"{role}.attempt{attempt}.json").read_text())


def assert_private(run_dir: Path) -> None:
    """The run directory and everything the job wrote there (the batch log, each task's files: the
    script's umask reached them through srun) belong to the user alone (issue 28)."""
    for path in [run_dir, *run_dir.rglob("*")]:
        assert path.stat().st_mode & 0o077 == 0, f"{path} is {oct(path.stat().st_mode & 0o777)}"


def test_hetjob_places_roles_and_wires_them(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    user_token = secrets.token_hex(32)  # run.token: sbatch hands it to the job in its environment
    job_id, run_dir = submit(
        slurm_cluster,
        tmp_path,
        "wiring",
        "trainer.total_steps=3",
        "+cluster.nccl_env.NCCL_SOCKET_IFNAME=lo",
        f"run.token={user_token}",
    )
    assert slurm_cluster.wait_until_done(job_id, timeout_s=120) == ["COMPLETED", "COMPLETED"]

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["rollout"]["num_servers"] == 3 and config["run"]["token"] == ""
    base_port = config["rollout"]["base_port"]
    token_file = run_dir / "job_token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text()
    assert token == user_token
    assert "job token: given at submission" in (run_dir / "logs" / f"sbatch-{job_id}.out").read_text()
    for path in run_dir.rglob("*"):  # the token's one file is job_token (0600)
        # (fake/ holds what the stand-in roles record of their environment, the token included)
        if path.is_file() and path != token_file and path.parent.name != "fake":
            assert user_token not in path.read_text(errors="replace"), path
    assert_private(run_dir)

    # group 0: one server per rollout node, each on its own fake GPU, registered for discovery
    nodes = []
    for index in range(3):
        registration = json.loads((run_dir / "servers" / f"{index}.json").read_text())
        assert registration == {"index": index, "host": "127.0.0.1", "port": base_port + index}
        env = _snapshot(run_dir, f"server{index}")
        assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["AREAL_JOB_TOKEN"] == token
        assert env["AREAL_BIND_HOST"] == "127.0.0.1" and env["NCCL_SOCKET_IFNAME"] == "lo"
        nodes.append(env["SLURMD_NODENAME"])
    assert sorted(nodes) == ["n1", "n2", "n3"]

    # group 1: trainer rank and controller on the trainer node, pointed at each other
    trainer = _snapshot(run_dir, "trainer0")
    assert trainer["SLURMD_NODENAME"] == "n4"
    assert (trainer["RANK"], trainer["WORLD_SIZE"], trainer["LOCAL_RANK"]) == ("0", "1", "0")
    assert (
        trainer["MASTER_ADDR"]
        == trainer["AREAL_CONTROLLER_HOST"]
        == trainer["AREAL_BIND_HOST"]
        == "127.0.0.1"
    )
    assert trainer["MASTER_PORT"] == str(config["cluster"]["master_port"])
    controller = _snapshot(run_dir, "controller")
    assert controller["SLURMD_NODENAME"] == "n4" and controller["AREAL_JOB_TOKEN"] == token

    logs = run_dir / "logs"
    for index in range(3):
        assert f"server {index} stopped" in (logs / f"rollout-server-{index}.log").read_text()
    assert "3 servers registered" in (logs / "controller.log").read_text()
    assert "done at step 3" in (logs / "trainer-0.log").read_text()
    assert "trainer exited with 0" in (logs / f"sbatch-{job_id}.out").read_text()
    assert json.loads((run_dir / "summary.json").read_text()) == {"start_step": 0, "final_step": 3}
    assert slurm_cluster.leftover_job_processes() == []


def test_usr1_checkpoints_requeues_and_resumes(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    total = 100
    job_id, run_dir = submit(slurm_cluster, tmp_path, "preempt", f"trainer.total_steps={total}")
    progress = run_dir / "fake" / "progress"
    deadline = time.monotonic() + 120
    while not (progress.exists() and int(progress.read_text()) >= 3):
        assert time.monotonic() < deadline, f"trainer made no progress: {slurm_cluster.job_states(job_id)}"
        time.sleep(0.2)

    # what --signal=B:USR1@<s> does before the time limit
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", job_id)
    assert slurm_cluster.wait_until_done(job_id, timeout_s=240) == ["COMPLETED", "COMPLETED"]

    batch_log = (run_dir / "logs" / f"sbatch-{job_id}.out").read_text()
    assert "checkpoint written: requeueing" in batch_log, batch_log
    assert batch_log.count("job token: generated for this attempt") == 2, batch_log  # one per attempt
    assert_private(run_dir)
    assert "attempt 1] start" in batch_log, batch_log
    shown = slurm_cluster.run("scontrol", "show", "job", job_id).stdout
    assert "Restarts=1" in shown, shown

    checkpoint_step = int((run_dir / "checkpoints" / "fake_step").read_text())
    assert 0 < checkpoint_step < total
    assert (run_dir / "fake" / "controller_state.json").exists()
    assert _snapshot(run_dir, "trainer0", attempt=1)["SLURM_RESTART_COUNT"] == "1"
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert f"checkpoint at step {checkpoint_step}" in trainer_log
    assert f"starting at step {checkpoint_step}" in trainer_log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == {"start_step": checkpoint_step, "final_step": total}
    assert slurm_cluster.leftover_job_processes() == []


def test_a_crashing_server_is_restarted_in_place_then_given_up_and_the_job_goes_on(
    slurm_cluster: LocalSlurm, tmp_path: Path
) -> None:
    """Server 1 crashes 1 s after every start: its supervisor restarts it (rollout.max_server_restarts,
    with backoff), then gives up; the other servers and the trainer run on and the job completes."""
    run_dir = tmp_path / "runs" / "crash"
    (run_dir / "fake").mkdir(parents=True)
    (run_dir / "fake" / "crash_server1").touch()
    job_id, _ = submit(
        slurm_cluster, tmp_path, "crash", "trainer.total_steps=60", "rollout.max_server_restarts=2"
    )
    assert slurm_cluster.wait_until_done(job_id, timeout_s=180) == ["COMPLETED", "COMPLETED"]
    log = (run_dir / "logs" / "rollout-server-1.log").read_text()
    assert log.count("server 1: injected crash") == 3, log  # the first start and 2 restarts
    assert "restart 1/2 in 1 s" in log and "restart 2/2 in 2 s" in log and "giving up" in log, log
    batch_log = (run_dir / "logs" / f"sbatch-{job_id}.out").read_text()
    assert "exited while the trainer was running" not in batch_log, batch_log
    assert "server 0 stopped" in (run_dir / "logs" / "rollout-server-0.log").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 60
    assert slurm_cluster.leftover_job_processes() == []


def test_every_server_giving_up_fails_the_job_instead_of_hanging(
    slurm_cluster: LocalSlurm, tmp_path: Path
) -> None:
    run_dir = tmp_path / "runs" / "crash-all"
    (run_dir / "fake").mkdir(parents=True)
    for index in range(3):
        (run_dir / "fake" / f"crash_server{index}").touch()
    job_id, _ = submit(
        slurm_cluster, tmp_path, "crash-all", "trainer.total_steps=100000", "rollout.max_server_restarts=1"
    )
    states = slurm_cluster.wait_until_done(job_id, timeout_s=120)
    assert states[0] == "FAILED", states
    batch_log = (run_dir / "logs" / f"sbatch-{job_id}.out").read_text()
    assert "rollout servers exited while the trainer was running" in batch_log, batch_log
    assert "giving up" in (run_dir / "logs" / "rollout-server-1.log").read_text()
    assert not (run_dir / "summary.json").exists()
    assert slurm_cluster.leftover_job_processes() == []
