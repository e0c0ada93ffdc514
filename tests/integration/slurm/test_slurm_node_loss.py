"""A node of the rendered job is lost (`scontrol update nodename=<node> state=DOWN`), with stand-in
roles (fake_roles.py).

Where both groups have 2+ nodes the renderer makes them `--no-kill`: a lost rollout node then
leaves the job, which runs on with the other servers, and a lost trainer node means
checkpoint-restart, as before (the job script requeues the job). Elsewhere (a 1-node group) SLURM
22.05 requeues the whole job on any lost node (docs/faults.md has what `--no-kill` does there). The
batch host (the first rollout node) is the one rollout node SLURM never survives.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import fake_roles
import pytest
from local_slurm import NUM_NODES, LocalSlurm
from test_slurm_hetjob import submit

pytestmark = pytest.mark.slurm

TOTAL_STEPS = 100  # 30 s of fake training (fake_roles.STEP_S), until the test hurries it


def batch_host(cluster: LocalSlurm, job_id: str) -> str:
    shown = cluster.run("scontrol", "-o", "show", "job", job_id).stdout.splitlines()[0]
    return dict(f.split("=", 1) for f in shown.split() if "=" in f)["BatchHost"]


def server_nodes(run_dir: Path, count: int) -> dict[int, str]:
    return {
        i: json.loads((run_dir / "fake" / f"server{i}.attempt0.json").read_text())["SLURMD_NODENAME"]
        for i in range(count)
    }


@pytest.fixture(autouse=True)
def every_node_back_in_service(slurm_cluster: LocalSlurm):
    """The node a test set DOWN comes back by itself (ReturnToService=2: its slurmd still answers);
    the next test of the session starts only once every node is idle again, so none of them waits
    for a node (nor sees fewer)."""
    yield
    deadline = time.monotonic() + 300
    while (states := slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split()[1::2]) != [
        "idle"
    ] * NUM_NODES:
        assert time.monotonic() < deadline, f"nodes not back in service: {states}"
        time.sleep(0.5)


def lose_a_node(
    cluster: LocalSlurm, tmp_path: Path, name: str, role: str, *overrides: str
) -> tuple[str, Path, str]:
    """Submit, wait for 3 trained steps, set the last node of `role` ("server" or "trainer") other
    than the batch host DOWN. Returns (job id, run dir, the role's snapshot name on that node)."""
    job_id, run_dir = submit(cluster, tmp_path, name, f"trainer.total_steps={TOTAL_STEPS}", *overrides)
    progress = run_dir / "fake" / "progress"
    deadline = time.monotonic() + 120
    while not (progress.exists() and int(progress.read_text()) >= 3):
        assert time.monotonic() < deadline, f"no progress: {cluster.job_states(job_id)}"
        time.sleep(0.2)
    host = batch_host(cluster, job_id)
    while True:  # every task of the role has started (each records its node when it starts)
        try:
            nodes = {
                path.name.split(".")[0]: json.loads(path.read_text())["SLURMD_NODENAME"]
                for path in sorted((run_dir / "fake").glob(f"{role}*.attempt0.json"))
            }
        except ValueError:  # a record being written
            nodes = {}
        candidates = [(n, node) for n, node in nodes.items() if node != host]
        if len(nodes) >= 2 and candidates:
            break
        assert time.monotonic() < deadline, f"{role}s started: {nodes}"
        time.sleep(0.2)
    name, victim = candidates[-1]
    cluster.run("scontrol", "update", f"nodename={victim}", "state=DOWN", "reason=test")
    return job_id, run_dir, name


def hurry_once_logged(cluster: LocalSlurm, job_id: str, run_dir: Path, line: str) -> None:
    """Wait until the job script logged `line` (the loss was handled), then let the fake trainer
    run out its remaining steps quickly (fake_roles.hurry): the rest of the run is not the test."""
    batch_log = run_dir / "logs" / f"sbatch-{job_id}.out"
    deadline = time.monotonic() + 180
    while not (batch_log.exists() and line in batch_log.read_text()):
        assert time.monotonic() < deadline, f"{line!r} not logged: {cluster.job_states(job_id)}\n" + (
            batch_log.read_text() if batch_log.exists() else "(no batch log)"
        )
        if "PENDING" in cluster.job_states(job_id):
            cluster.nudge_backfill()
        time.sleep(0.2)
    fake_roles.hurry(run_dir)


TWO_PLUS_TWO = ["cluster.nodes=4", "cluster.rollout_fraction=0.5", "trainer=fsdp"]


def test_the_job_survives_a_lost_rollout_node(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    """2 rollout + 2 trainer nodes: the lost node leaves the job, the other server serves on and the
    trainer ends its run in the first attempt."""
    job_id, run_dir, lost = lose_a_node(slurm_cluster, tmp_path, "lose-rollout", "server", *TWO_PLUS_TWO)
    hurry_once_logged(slurm_cluster, job_id, run_dir, "rollout node lost: 2 -> 1 rollout nodes")
    states = slurm_cluster.wait_until_done(job_id, timeout_s=180)
    shown = slurm_cluster.run("scontrol", "show", "job", job_id).stdout
    batch_log = (run_dir / "logs" / f"sbatch-{job_id}.out").read_text()
    assert states == ["COMPLETED", "COMPLETED"], shown + batch_log
    assert "Restarts=0" in shown, shown
    assert "rollout node lost: 2 -> 1 rollout nodes" in batch_log, batch_log
    assert "exited while the trainer was running" not in batch_log, batch_log
    assert json.loads((run_dir / "summary.json").read_text()) == {"start_step": 0, "final_step": TOTAL_STEPS}
    survivor = 1 - int(lost.removeprefix("server"))
    assert f"server {survivor} stopped" in (run_dir / "logs" / f"rollout-server-{survivor}.log").read_text()
    assert slurm_cluster.leftover_job_processes() == []


def test_a_lost_trainer_node_means_checkpoint_restart(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    """2 + 2 nodes: the job script sees its trainer lost and requeues the job; the next attempt
    trains to the end."""
    job_id, run_dir, _ = lose_a_node(slurm_cluster, tmp_path, "lose-trainer", "trainer", *TWO_PLUS_TWO)
    hurry_once_logged(slurm_cluster, job_id, run_dir, "attempt 1] start")
    states = slurm_cluster.wait_until_done(job_id, timeout_s=300)
    batch_log = (run_dir / "logs" / f"sbatch-{job_id}.out").read_text()
    shown = slurm_cluster.run("scontrol", "show", "job", job_id).stdout
    assert states == ["COMPLETED", "COMPLETED"], shown + batch_log
    assert "a trainer node left the job (node failure): requeueing" in batch_log, batch_log
    assert "Restarts=1" in shown and "attempt 1] start" in batch_log, shown + batch_log
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == TOTAL_STEPS
    assert slurm_cluster.leftover_job_processes() == []


def test_with_a_one_node_trainer_group_a_lost_rollout_node_requeues_the_job(
    slurm_cluster: LocalSlurm, tmp_path: Path
) -> None:
    """3 rollout nodes + 1 trainer node (cluster=local_slurm's layout) is rendered without --no-kill:
    SLURM requeues the whole job and the next attempt trains to the end."""
    job_id, run_dir, _ = lose_a_node(slurm_cluster, tmp_path, "lose-3+1", "server")
    hurry_once_logged(slurm_cluster, job_id, run_dir, "attempt 1] start")
    states = slurm_cluster.wait_until_done(job_id, timeout_s=300)
    batch_log = (run_dir / "logs" / f"sbatch-{job_id}.out").read_text()
    shown = slurm_cluster.run("scontrol", "show", "job", job_id).stdout
    assert states == ["COMPLETED", "COMPLETED"], shown + batch_log
    assert "Restarts=1" in shown and "attempt 1] start" in batch_log, shown + batch_log
    assert "rollout node lost" not in batch_log and "a trainer node left" not in batch_log, batch_log
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == TOTAL_STEPS
    assert slurm_cluster.leftover_job_processes() == []
