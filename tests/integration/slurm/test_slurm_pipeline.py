"""The real pipeline as one heterogeneous SLURM job: `make submit` with cluster=local_slurm.

3 rollout nodes run one CPU SGLang server each, the trainer node runs the torch trainer and the
rollout controller; the built-in tiny experiment trains, is preempted (USR1: checkpoint, requeue),
resumes in the job's second attempt and completes.
Heavy on 2 cores (three SGLang servers), so the experiment is cut to the bone by overrides: an
untrained tiny model (no SFT warm start), 3 steps of 2 x 2 samples, short answers, 4 eval prompts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from local_slurm import LocalSlurm, local_port_overrides

from areal_jobs.metrics import read_jsonl

pytestmark = [pytest.mark.slurm, pytest.mark.sglang, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
JOB_TIMEOUT_S = 1200  # three CPU SGLang servers starting at once on 2 cores dominate


def lean_overrides(tmp_path: Path, name: str, total_steps: int) -> list[str]:
    return [
        "cluster=local_slurm",
        f"run.root={tmp_path / 'runs'}",
        f"run.name={name}",
        f"model.builtin_dir={tmp_path / 'tiny-model'}",
        "model.builtin_sft_steps=0",
        f"trainer.total_steps={total_steps}",
        "algo.batch_size=2",
        "algo.group_size=2",
        "algo.max_staleness=1",
        "data.num_eval_prompts=4",
        "rollout.max_new_tokens=24",
        "rollout.max_concurrent=8",
        "reward.num_workers=1",
        "run.tensorboard=false",
        *local_port_overrides(3),
    ]


def make_submit(cluster: LocalSlurm, overrides: list[str]) -> str:
    """The user's path: `make submit OVERRIDES="..."` -> job id."""
    proc = subprocess.run(
        ["make", "--no-print-directory", "submit", f"OVERRIDES={' '.join(overrides)}"],
        cwd=REPO,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"submitted job (\d+)", proc.stdout)
    assert match, proc.stdout
    return match.group(1)


def processes_showing(secret: str) -> list[str]:
    """Every process on the machine whose command line (what `ps` shows any user) holds `secret`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes() if entry.isdigit() else b""
        except OSError:  # gone meanwhile
            continue
        if secret.encode() in cmdline:
            found.append(f"{entry}: " + cmdline.replace(b"\0", b" ").decode(errors="replace")[:300])
    return found


def processes_of_job(cluster: LocalSlurm, job_id: str) -> list[int]:
    """Processes slurmstepd started for `job_id` (they carry SLURM_JOB_ID; a het job's second group
    has its own id, the leader's + 1) and their children, which inherit it."""
    ids = {job_id.encode(), str(int(job_id) + 1).encode()}
    found = []
    for entry in os.listdir("/proc"):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes() if entry.isdigit() else b""
        except OSError:
            continue
        variables = dict(v.split(b"=", 1) for v in environ.split(b"\0") if b"=" in v)
        if (
            variables.get(b"SLURM_JOB_ID") in ids
            and variables.get(b"SLURM_CONF") == cluster.env["SLURM_CONF"].encode()
        ):
            found.append(int(entry))
    return found


def dump_logs(run_dir: Path) -> str:
    parts = []
    for log in sorted((run_dir / "logs").glob("*")):
        parts.append(f"===== {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
    return "\n".join(parts)


def test_usr1_checkpoints_and_the_requeued_job_resumes(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    """The contract with the roles (see docs/slurm.md):
    - on SIGUSR1 the trainer saves model, optimizer and step N under RUN_DIR/checkpoints/, logs
      `checkpoint saved at step N`, and exits 0; the controller saves its state and exits 0;
    - the next attempt (same run dir and config) logs `resumed from checkpoint at step N` and
      trains steps N+1..total_steps; summary.json `steps` is total_steps."""
    # Room for fast steps: USR1 goes scancel -> batch shell -> srun -> trainer, and a step of this
    # tiny job can be quicker than that on a loaded machine (6 steps were all done once, checkpoint
    # at step 6, so the resume trained nothing).
    total_steps = 12
    job_id = make_submit(slurm_cluster, lean_overrides(tmp_path, "tiny-preempt", total_steps))
    run_dir = tmp_path / "runs" / "tiny-preempt"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while sum("train/version" in row for row in read_jsonl(run_dir / "metrics.jsonl")) < 2:
        assert time.monotonic() < deadline, dump_logs(run_dir)
        # still waiting for nodes (first job of the session) or running, never ended
        assert set(slurm_cluster.job_states(job_id)) <= {"PENDING", "CONFIGURING", "RUNNING"}, dump_logs(
            run_dir
        )
        time.sleep(1)

    # issue 28: while the job's real roles run (SGLang servers and their children, controller,
    # reward workers, trainer), no process on the machine shows the job's token to `ps`
    token = (run_dir / "job_token").read_text()
    assert len(processes_of_job(slurm_cluster, job_id)) >= 6
    assert processes_showing(token) == []
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", job_id)
    states = slurm_cluster.wait_until_done(job_id, timeout_s=JOB_TIMEOUT_S)
    assert states == ["COMPLETED", "COMPLETED"], dump_logs(run_dir)
    for path in [run_dir, *run_dir.rglob("*")]:  # private, the checkpoint included
        assert path.stat().st_mode & 0o077 == 0, f"{path} is {oct(path.stat().st_mode & 0o777)}"

    batch_log = (run_dir / "logs" / f"sbatch-{job_id}.out").read_text()
    assert "checkpoint written: requeueing" in batch_log and "attempt 1] start" in batch_log, batch_log
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    saved = re.search(r"checkpoint saved at step (\d+)", trainer_log)
    assert saved, trainer_log
    step = int(saved.group(1))
    assert 0 < step < total_steps
    assert f"resumed from checkpoint at step {step}" in trainer_log

    # the experiment completed as a het job (one job for both checks: three SGLang servers twice
    # are what this costs)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == total_steps
    assert summary["max_staleness_seen"] <= 1 and summary["trained_tokens"] > 0
    assert 0.0 <= summary["accuracy_end"] <= 1.0
    trained = [
        int(row["train/version"]) for row in read_jsonl(run_dir / "metrics.jsonl") if "train/version" in row
    ]
    assert sorted(set(trained)) == list(range(1, total_steps + 1)), trained
    logs = run_dir / "logs"
    for index in range(3):  # each server's wrapper and SGLang logged to their own files
        assert (logs / f"rollout-server-{index}.log").exists()
        assert "sglang.launch_server" in (logs / f"sglang-{index}.log").read_text()
    assert "eval final" in (logs / "controller.log").read_text()
    assert "final: " in trainer_log
    assert "trainer exited with 0" in batch_log
    # nothing started by the job outlives it (SGLang forks a scheduler and a detokenizer)
    assert slurm_cluster.leftover_job_processes() == []
