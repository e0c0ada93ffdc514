"""The private SLURM cluster's helpers (the fixtures that start it are in conftest.py).

Test modules import these from here, never from conftest: several test directories have a
conftest.py, and which one `from conftest import ...` finds depends on the order pytest loaded
them (`pytest tests/integration/slurm tests/integration/vllm` found vllm's and failed to collect).
"""

from __future__ import annotations

import getpass
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from areal_jobs.transport import discovery

NUM_NODES = 4
GPUS_PER_NODE = 8
DAEMONS = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel")
DAEMON_MARK = "AREAL_TEST_SLURM_DAEMONS"  # in the daemons' environment only, inherited by their helpers

# submitit asks sacct for job states; without accounting, answer from the controller's memory.
_SACCT_SHIM = """#!/bin/sh
# test-only sacct: answers `sacct -o JobID,State,NodeList --parsable2 -j ID[,ID]` from squeue
ids=""
while [ $# -gt 0 ]; do
  case "$1" in -j|--jobs) ids="$2"; shift 2;; -j*) ids="${1#-j}"; shift;; *) shift;; esac
done
echo "JobID|State|NodeList"
[ -n "$ids" ] && squeue -h --states=all -j "$ids" -o "%i|%T|%N" 2>/dev/null
exit 0
"""


def free_port_block(count: int) -> int:
    """First of `count` consecutive free loopback ports below the ephemeral range (servers listen on
    base_port + index and bind minutes after submission: an ephemeral port could be taken by then)."""
    return discovery.free_ports("127.0.0.1", count, consecutive=True)[0]


@dataclass
class LocalSlurm:
    """Handle to the running test cluster; `env` is what every client command needs."""

    root: Path
    env: dict[str, str]
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, check=check)

    def job_states(self, job_id: str) -> list[str]:
        """States of every component of (het) job `job_id`, from the controller's memory."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        return [
            f.split("=", 1)[1] for line in out.splitlines() for f in line.split() if f.startswith("JobState=")
        ]

    def wait_until_done(self, job_id: str, timeout_s: float) -> list[str]:
        """Poll (sbatch --wait backs off to 32 s) until no component is pending or running."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = self.job_states(job_id)
            if states and not any(s in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING") for s in states):
                return states
            if "PENDING" in states:
                self.nudge_backfill()
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {self.job_states(job_id)} after {timeout_s}s")

    def leftover_job_processes(self, grace_s: float = 30.0) -> list[str]:
        """Processes started under this cluster, other than its daemons, still alive after a
        finished job has had `grace_s` to wind down (slurmstepd exits a moment after COMPLETED)."""
        daemons = {proc.pid for proc in self.daemons}
        deadline = time.monotonic() + grace_s
        while True:
            pids = [
                pid
                for pid in processes_of(self.root)
                if pid not in daemons and _comm(pid) != "slurmscriptd"  # slurmctld's own helper
            ]
            if not pids or time.monotonic() > deadline:
                return [describe(pid) for pid in pids]
            time.sleep(0.5)

    def nudge_backfill(self) -> None:
        """Het jobs are started only by the backfill scheduler, which reruns only after a job,
        node or partition change. A requeued job becomes eligible later (its begin time is
        cred_expire after the requeue) with no change to wake backfill on a quiet cluster; a
        busy one changes all the time. A no-op partition update plays that part here."""
        self.run("scontrol", "update", "PartitionName=debug", "State=UP", check=False)


def wait_for(cmd: list[str], env: dict[str, str], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if subprocess.run(cmd, check=False, env=env, capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{what} not ready after {timeout_s}s")


def write_config(root: Path) -> Path:
    for sub in ("etc", "state", "spool", "log", "run", "dev", "bin"):
        (root / sub).mkdir()
    # the daemons' ports from one call, so no two of them are the same port
    *node_ports, ctld_port = discovery.free_ports("127.0.0.1", NUM_NODES + 1)
    node_lines = "".join(
        f"NodeName=n{i + 1} NodeHostname=localhost NodeAddr=127.0.0.1 Port={node_ports[i]} "
        f"CPUs=32 RealMemory=256000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN\n"
        for i in range(NUM_NODES)
    )
    conf = root / "etc/slurm.conf"
    conf.write_text(
        f"ClusterName=areal-pytest\nSlurmctldHost=localhost\nSlurmctldPort={ctld_port}\n"
        "SlurmUser=root\nAuthType=auth/none\nCredType=cred/none\n"
        # a requeued job may start again only after cred_expire (default 120 s)
        "AuthInfo=cred_expire=5\n"
        f"StateSaveLocation={root}/state\nSlurmdSpoolDir={root}/spool/%n\n"
        f"SlurmctldPidFile={root}/run/slurmctld.pid\nSlurmdPidFile={root}/run/slurmd-%n.pid\n"
        f"SlurmctldLogFile={root}/log/slurmctld.log\nSlurmdLogFile={root}/log/slurmd-%n.log\n"
        "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
        "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
        # only the backfill scheduler starts het jobs; its default 30 s sleep would dominate
        "SchedulerType=sched/backfill\nSchedulerParameters=bf_interval=1,sched_interval=2\n"
        "SlurmdParameters=config_overrides\nAccountingStorageType=accounting_storage/none\n"
        "JobAcctGatherType=jobacct_gather/none\nJobCompType=jobcomp/none\nMpiDefault=none\n"
        "MailProg=/bin/true\nReturnToService=2\nMinJobAge=600\nKillWait=5\nInactiveLimit=0\n"
        # slurmctld pings the nodes every SlurmdTimeout / 3 s (default 300 / 3). A het job that a
        # node failure requeued can fail its first start ("Requested nodes are busy": one group
        # became eligible a second before the other) and then waits for the next ping of its
        # nodes: up to 100 s by default (measured: 108 s and 183 s), 10 s here
        "SlurmdTimeout=30\n"
        f"GresTypes=gpu\n{node_lines}"
        f"PartitionName=debug Nodes=n[1-{NUM_NODES}] Default=YES MaxTime=INFINITE State=UP\n"
    )
    # slurmd needs one character device per GPU; /dev/null stands in
    for gpu in range(GPUS_PER_NODE):
        os.symlink("/dev/null", root / f"dev/nvidia{gpu}")
    (root / "etc/gres.conf").write_text(
        f"AutoDetect=off\nNodeName=n[1-{NUM_NODES}] Name=gpu File={root}/dev/nvidia[0-{GPUS_PER_NODE - 1}]\n"
    )
    shim = root / "bin/sacct"
    shim.write_text(_SACCT_SHIM)
    shim.chmod(0o755)
    return conf


def processes_of(root: Path) -> list[int]:
    """Live pids the cluster rooted at `root` started: its daemons and their helpers (slurmscriptd,
    slurmstepd) carry DAEMON_MARK; job processes carry its SLURM_CONF and a SLURM_JOB_ID. A process
    of the test session that happens to inherit SLURM_CONF (a client command, multiprocessing's
    resource tracker) has no job id and is not the cluster's to answer for."""
    daemon_mark = f"{DAEMON_MARK}={root}".encode()
    conf_mark = f"SLURM_CONF={root / 'etc/slurm.conf'}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        in_job = conf_mark in environ and any(var.startswith(b"SLURM_JOB_ID=") for var in environ)
        if (daemon_mark in environ or in_job) and stat[0] != "Z":  # zombies are reaped late by PID 1 here
            pids.append(int(entry.name))
    return pids


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def describe(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"{pid}: (gone)"
    return f"{pid}: " + " ".join(arg.decode(errors="replace") for arg in argv).strip()


def drain(cluster: LocalSlurm) -> None:
    cluster.run("scancel", "-u", getpass.getuser(), check=False)
    deadline = time.monotonic() + 60
    spool = cluster.root / "spool"
    while time.monotonic() < deadline:
        queued = cluster.run("squeue", "-h", check=False).stdout.strip()
        sockets = [p for p in spool.rglob("*") if p.is_socket()]
        if not queued and not sockets:
            return
        time.sleep(0.2)


def local_port_overrides(num_servers: int) -> list[str]:
    """Free loopback ports for every role: on local_slurm all 'nodes' share this host.

    One block from one call: ports picked by separate calls are each free but may be the same
    port (nothing holds them between calls), which `launch.submit` then refuses. The servers
    come last, with room for as many again (a satellite or a grown pool serves at base_port + index)."""
    first = free_port_block(4 + 2 * num_servers)
    return [
        f"rollout.controller_port={first}",  # and controller_port+1
        f"weight_sync.master_port={first + 2}",
        f"cluster.master_port={first + 3}",
        f"rollout.base_port={first + 4}",
    ]
