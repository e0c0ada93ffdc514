"""A private SLURM 22.05 cluster on loopback: slurmctld + one slurmd per fake node, fake GPUs.

The daemons are Popen children of pytest with ports from the OS and every file under a tmp dir,
so parallel sessions do not collide and nothing is written elsewhere. Jobs are cancelled and
drained before `scontrol shutdown` (a shutdown alone leaves running slurmstepd behind), and the
teardown fails the session if any process the cluster started survives: its daemons and their
helpers (marked by an environment variable only they carry) and the processes of its jobs (this
cluster's SLURM_CONF plus the SLURM_JOB_ID that slurmstepd gives them). Nothing else in the session
is looked at, and the session's own environment is never changed: only a test that asks for
`slurm_cluster` sees SLURM_CONF and the sacct shim on PATH, for its own duration.
Fails, naming the command that installs it, where SLURM is missing (`make test` installs it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import warnings

import pytest
from local_slurm import (
    DAEMON_MARK,
    DAEMONS,
    NUM_NODES,
    LocalSlurm,
    describe,
    drain,
    processes_of,
    wait_for,
    write_config,
)


@pytest.fixture(scope="session")
def slurm_cluster_session(tmp_path_factory: pytest.TempPathFactory):
    """The cluster, started once per session; its environment lives in `env`, never in os.environ."""
    search = f"{os.environ['PATH']}:/usr/sbin:/sbin"  # the daemons live in sbin, off a user's PATH
    missing = [tool for tool in DAEMONS if shutil.which(tool, path=search) is None]
    if missing:
        pytest.fail(
            f"SLURM is not installed (missing {', '.join(missing)}): `make system-packages` installs the "
            "packages of requirements/apt.txt as root, or prints the apt-get command to run"
        )
    root = tmp_path_factory.mktemp("slurm")
    conf = write_config(root)
    env = dict(os.environ, SLURM_CONF=str(conf), PATH=f"{root}/bin:{search}")
    daemon_io = {
        "stdout": subprocess.DEVNULL,
        "stderr": subprocess.DEVNULL,
        "env": {**env, DAEMON_MARK: str(root)},
    }
    procs = [subprocess.Popen(["slurmctld", "-D", "-i"], **daemon_io)]
    cluster = LocalSlurm(root=root, env=env, daemons=procs)
    try:
        wait_for(["scontrol", "ping"], env, "slurmctld")
        procs += [
            subprocess.Popen(["slurmd", "-D", "-N", f"n{i + 1}"], **daemon_io) for i in range(NUM_NODES)
        ]
        idle = f'[ "$(sinfo -h -t idle -o %D)" = {NUM_NODES} ]'
        wait_for(["bash", "-c", idle], env, f"{NUM_NODES} idle slurmd")
        yield cluster
    finally:
        drain(cluster)
        cluster.run("scontrol", "shutdown", check=False)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        leftovers = processes_of(root)
        described = [describe(pid) for pid in leftovers]
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        assert not leftovers, f"processes of the test cluster survived shutdown: {described}"


@pytest.fixture
def slurm_cluster(slurm_cluster_session: LocalSlurm, monkeypatch: pytest.MonkeyPatch):
    """The session's cluster, with SLURM_CONF and PATH set for this test only: clients called in
    process (submitit in launch/slurm/aux_jobs.py) find it; other tests never see it.

    Every job a test leaves queued or running is cancelled when it ends, so one failing test
    fails alone: a job left running held n1 and n2, and the tests after it were placed on n3 and
    n4 and failed their placement checks (CI, stop 46)."""
    monkeypatch.setenv("SLURM_CONF", slurm_cluster_session.env["SLURM_CONF"])
    monkeypatch.setenv("PATH", slurm_cluster_session.env["PATH"])
    yield slurm_cluster_session
    left = slurm_cluster_session.run("squeue", "-h", "-o", "%i %T %j", check=False).stdout.strip()
    if left:
        warnings.warn(f"jobs left by the test, cancelled: {left}", stacklevel=1)
        drain(slurm_cluster_session)
