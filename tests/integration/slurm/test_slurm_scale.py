"""`make scale RUN=<run dir> ROLLOUT_NODES=+1` then `-1` on a running SLURM job, real roles.

The job (`make submit`, cluster=local_slurm cut to 2 nodes) runs one CPU SGLang server, the
controller and the torch trainer. `python -m launch.scale RUN_DIR +1` submits a satellite job whose
server (index 1) registers through the run directory; the controller admits it at the next weight
update, and it serves requests. Then the job's own server is killed (kill -9 of its SGLang process
group): its supervisor restarts it in place and it rejoins with the current weights while the
satellite serves. `-1` drains the satellite's server (no request lost), then ends the satellite job.
The job is then preempted (USR1: checkpoint) and its requeued attempt cancelled; the ledger shows
every step's samples once. Two SGLang starts on 2 cores dominate the run time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_slurm_pipeline as pipeline  # its helpers; a module import keeps its tests out of this module
from local_slurm import LocalSlurm

from areal_jobs.metrics import read_jsonl

pytestmark = [pytest.mark.slurm, pytest.mark.sglang, pytest.mark.slow]

TIMEOUT_S = 1200
ETA = 1  # lean_overrides' algo.max_staleness


def scale(cluster: LocalSlurm, run_dir: Path, change: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "launch.scale", str(run_dir), change, "--drain-timeout-s=600"],
        cwd=pipeline.REPO, env=cluster.env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def steps(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return (
        sum('"train/version"' in line for line in metrics.read_text().splitlines()) if metrics.exists() else 0
    )


def wait_for(what: str, done, cluster: LocalSlurm, job_id: str, run_dir: Path):
    deadline = time.monotonic() + TIMEOUT_S
    while not (found := done()):
        assert time.monotonic() < deadline, f"{what}: not after {TIMEOUT_S}s\n{pipeline.dump_logs(run_dir)}"
        assert cluster.job_states(job_id) == ["RUNNING", "RUNNING"], pipeline.dump_logs(run_dir)
        time.sleep(1)
    return found


def controller_log(run_dir: Path, pattern: str):
    return re.search(pattern, (run_dir / "logs" / "controller.log").read_bytes().decode(errors="replace"))


def controller_logs(run_dir: Path, pattern: str) -> list[str]:
    return re.findall(pattern, (run_dir / "logs" / "controller.log").read_bytes().decode(errors="replace"))


def test_a_satellite_node_joins_serves_and_drains(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    overrides = pipeline.lean_overrides(tmp_path, "scale", 100_000)
    overrides += ["cluster.nodes=2", "cluster.rollout_fraction=0.5", "rollout.health_interval_s=1"]
    job_id = pipeline.make_submit(slurm_cluster, overrides)
    run_dir = tmp_path / "runs" / "scale"
    wait_for("2 steps", lambda: steps(run_dir) >= 2, slurm_cluster, job_id, run_dir)

    t_add = time.monotonic()
    added = scale(slurm_cluster, run_dir, "+1")
    assert (added["rollout_nodes_before"], added["rollout_nodes"]) == (1, 2)
    [satellite] = added["added"]
    assert satellite["servers"] == [1]
    sat_id = satellite["job_id"]
    assert (run_dir / "satellite-1.sbatch").exists()
    joined = wait_for(
        "server 1 rejoins at a version",
        lambda: controller_log(run_dir, r"servers \[1\] rejoin at version (\d+)"),
        slurm_cluster, job_id, run_dir,
    )  # fmt: skip
    join_s = time.monotonic() - t_add
    assert controller_log(run_dir, r"server 1 joins the job at ")
    assert slurm_cluster.job_states(sat_id) == ["RUNNING"]
    done = steps(run_dir)
    wait_for("3 more steps", lambda: steps(run_dir) >= done + 3, slurm_cluster, job_id, run_dir)

    # kill -9 the job's own server (its SGLang process group) while the satellite serves: its
    # supervisor starts it again in place, it rejoins with the current weights, the job runs on
    victim = json.loads((run_dir / "servers" / "0.json").read_text())
    rejoins = len(controller_logs(run_dir, r"servers \[0\] rejoin at version (\d+)"))
    t_kill = time.monotonic()
    os.killpg(victim["pid"], signal.SIGKILL)
    wait_for(
        "server 0 restarted in place and rejoined",
        lambda: controller_logs(run_dir, r"servers \[0\] rejoin at version (\d+)")[rejoins:],
        slurm_cluster, job_id, run_dir,
    )  # fmt: skip
    heal_s = time.monotonic() - t_kill
    assert json.loads((run_dir / "servers" / "0.json").read_text())["pid"] != victim["pid"]
    assert "restart 1/" in (run_dir / "logs" / "rollout-server-0.log").read_text()
    done = steps(run_dir)
    wait_for("2 steps after the heal", lambda: steps(run_dir) >= done + 2, slurm_cluster, job_id, run_dir)

    t_drain = time.monotonic()
    released = scale(slurm_cluster, run_dir, "-1")
    drain_s = time.monotonic() - t_drain
    assert released["released"] == [{"job_id": sat_id, "servers": [1]}]
    drained = controller_log(run_dir, r"server 1 drained after (\d+) requests")
    assert drained and int(drained.group(1)) > 0, "the satellite's server never served a request"
    assert slurm_cluster.job_states(sat_id) == ["COMPLETED"]  # ended by its own script, not killed
    assert json.loads((run_dir / "satellites.json").read_text()) == []
    assert not (run_dir / "servers" / "1.json").exists()
    sat_log = (run_dir / "logs" / f"satellite-{sat_id}.out").read_text()
    assert "launch.scale asked to stop: stopping the servers" in sat_log, sat_log
    done = steps(run_dir)
    wait_for("2 steps on one server", lambda: steps(run_dir) >= done + 2, slurm_cluster, job_id, run_dir)

    # preempt: the trainer checkpoints, the job requeues itself; the next attempt is not wanted
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", job_id)
    batch_log = run_dir / "logs" / f"sbatch-{job_id}.out"
    deadline = time.monotonic() + TIMEOUT_S
    # Cancel only once the requeue took effect and the job is back in the queue: the script logs
    # this line just before it runs `scontrol requeue`, which also requeues a job already cancelled,
    # so a scancel sent on the log line alone was undone and the job ran again (CI, stop 46); a job
    # still completing may refuse the cancel. The requeued attempt cannot start before the
    # credentials expire (120 s), so the cancel lands on a pending job.
    while not (
        "checkpoint written: requeueing" in batch_log.read_text()
        and "Restarts=1" in slurm_cluster.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        and set(slurm_cluster.job_states(job_id)) == {"PENDING"}
    ):
        assert time.monotonic() < deadline, pipeline.dump_logs(run_dir)
        time.sleep(0.2)
    slurm_cluster.run("scancel", job_id)
    assert set(slurm_cluster.wait_until_done(job_id, timeout_s=120)) == {"CANCELLED"}

    rows = read_jsonl(run_dir / "ledger.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    samples = [s for r in rows for s in r["samples"]]
    assert len(samples) == len(set(samples)) == len(rows) * 2 * 2  # B x G each step: none lost, none twice
    assert all(r["trained_at_version"] - r["oldest_version"] <= ETA for r in rows)
    assert slurm_cluster.leftover_job_processes() == []
    print(
        f"\nsatellite {sat_id}: server 1 served from version {joined.group(1)} {join_s:.0f}s after +1, "
        f"{drained.group(1)} requests; server 0 kill -9 -> restarted in place, rejoined in {heal_s:.0f}s; "
        f"-1 drained and released it in {drain_s:.0f}s; {len(rows)} steps"
    )
