"""Grow or shrink the rollout pool of a running SLURM job with satellite jobs (launch.scale's SLURM side).

`python -m launch.scale RUN_DIR +N` (`make scale RUN=<run dir> ROLLOUT_NODES=+N`) submits N
satellite jobs of one rollout node each, rendered from the run's own config.yaml
(sbatch/satellite.sbatch.tmpl, written to RUN_DIR/satellite-<k>.sbatch). Their servers take fresh
indices (never reused in a run), run under the supervisor like the job's own, and register in
RUN_DIR/servers/<index>.json: the controller admits them exactly like a server added by
launch.local, and they take work once a weight update gave them the current weights.

`-N` takes the N satellites added last: it writes the drain markers of their servers (highest
indices first), waits until the controller answered every `<index>.drained` (none of their requests
in flight any more: no request is lost), then ends each satellite with `scancel --batch
--signal=TERM <id>` (its script stops the servers gracefully), waits for it to leave the queue and
falls back to a plain `scancel <id>`. The job's own rollout nodes are part of its allocation and
cannot be released; `-N` beyond the satellites is refused.

RUN_DIR/satellites.json lists the live satellites: [{"job_id", "first_index", "num_servers"}].
A satellite never outlives its run: its script ends its servers once RUN_DIR/summary.json exists,
the main job leaves RUNNING (ended, cancelled, requeued) or the job's key changed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shlex
import time
from collections.abc import Callable
from pathlib import Path

from areal_jobs.atomic import write_atomic
from areal_jobs.config import JobConfig, load_job_config
from areal_jobs.transport import discovery
from launch.planning.layout.plan import plan_job
from launch.slurm.cli import SlurmError, cancel_quietly, parse_job_id, run_command, signal_batch_script
from launch.slurm.render import (
    SbatchTemplate,
    engine_python,
    job_name,
    nccl_exports,
    sbatch_component,
    srun_container,
)

logger = logging.getLogger("launch.scale")

TEMPLATE_PATH = Path(__file__).resolve().parents[2] / "sbatch" / "satellite.sbatch.tmpl"
SATELLITES_FILE = "satellites.json"


@dataclasses.dataclass(frozen=True)
class Satellite:
    job_id: str
    first_index: int
    num_servers: int

    @property
    def indices(self) -> list[int]:
        return list(range(self.first_index, self.first_index + self.num_servers))


def read_satellites(run_dir: Path) -> list[Satellite]:
    path = Path(run_dir) / SATELLITES_FILE
    if not path.exists():
        return []
    return [
        Satellite(str(s["job_id"]), int(s["first_index"]), int(s["num_servers"]))
        for s in json.loads(path.read_text())
    ]


def write_satellites(run_dir: Path, satellites: list[Satellite]) -> None:
    write_atomic(Path(run_dir) / SATELLITES_FILE, json.dumps([dataclasses.asdict(s) for s in satellites]))


def main_job_id(run_dir: Path) -> str:
    """The running attempt's job id, from RUN_DIR/endpoints.env (written by the job script)."""
    path = Path(run_dir) / "endpoints.env"
    if not path.exists():
        raise ValueError(f"{run_dir} has no endpoints.env: its job has not started yet (make status JOB=...)")
    for line in path.read_text().splitlines():
        if line.startswith("SLURM_JOB_ID="):
            return line.split("=", 1)[1].strip()
    raise ValueError(f"{path} names no SLURM_JOB_ID")


def next_index(job: JobConfig, run_dir: Path, satellites: list[Satellite]) -> int:
    """First server index never used in this run: past the job's own servers, every registration,
    drain marker and satellite (an index is never reused: its drain markers stay)."""
    used = [job.rollout.num_servers - 1]
    used += [rec.index for rec in discovery.read_servers(run_dir)]
    used += list(discovery.leaving(run_dir))
    used += [s.first_index + s.num_servers - 1 for s in satellites]
    return max(used) + 1


def render_satellite(job: JobConfig, run_dir: Path, main_job: str, first_index: int) -> tuple[str, int]:
    """(script text, servers in it) of one satellite node for the planned job `job`."""
    plan = plan_job(job)
    cluster = job.cluster
    title = f"rollout servers joining job {main_job}"
    header = [
        f"#SBATCH --job-name={job_name(job)}-rollout-sat",
        f"#SBATCH --output={run_dir}/logs/satellite-%j.out",
        "#SBATCH --open-mode=append",
        f"#SBATCH --chdir={cluster.workdir}",
        "#SBATCH --no-requeue",  # a requeued main job starts its own servers; a satellite just ends
        *sbatch_component(cluster, title, 1, plan.servers_per_node),
    ]
    num_servers = plan.servers_per_node
    values = {
        "sbatch_header": "\n".join(header),
        "run_dir": shlex.quote(str(run_dir)),
        "python": shlex.quote(cluster.python),
        "rollout_engine": job.rollout.engine.value,
        "engine_python": shlex.quote(engine_python(job)),
        "rollout_tp": str(plan.rollout_tp),
        "servers_per_node": str(plan.servers_per_node),
        "first_index": str(first_index),
        "last_index": str(first_index + num_servers - 1),
        "main_job_id": main_job,
        "loopback": "1" if cluster.loopback else "0",
        "nccl_exports": nccl_exports(cluster),
        "srun_container": srun_container(cluster),
        "watch_interval_s": str(cluster.satellite_watch_s),
        "umask": f"{job.run.umask:03o}",
    }
    return SbatchTemplate(TEMPLATE_PATH.read_text()).substitute(values), num_servers


# states of a job that holds (or will hold) nodes; a finished job may stay listed for MinJobAge
LIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


def job_state(job_id: str) -> str:
    """The job's state from squeue ("PENDING,RUNNING" where the groups of a het job differ), "" once
    it is no longer queued or running."""
    try:
        states = set(run_command(["squeue", "-h", "-j", job_id, "-o", "%T"]).split()) & LIVE_STATES
    except SlurmError:  # squeue -j of a job already purged from the controller's memory
        return ""
    return ",".join(sorted(states))


def grow(run_dir: Path, nodes: int) -> list[Satellite]:
    job = load_job_config(run_dir / "config.yaml")
    main_job = main_job_id(run_dir)
    if job_state(main_job) != "RUNNING":
        raise ValueError(f"job {main_job} of {run_dir} is not running ({job_state(main_job) or 'gone'})")
    satellites = read_satellites(run_dir)
    added = []
    for _ in range(nodes):
        first = next_index(job, run_dir, satellites)
        script, count = render_satellite(job, run_dir, main_job, first)
        path = run_dir / f"satellite-{first}.sbatch"
        path.write_text(script)
        path.chmod(0o755)
        satellite = Satellite(parse_job_id(run_command(["sbatch", "--parsable", str(path)])), first, count)
        satellites.append(satellite)
        write_satellites(run_dir, satellites)  # at once: a later failure must not lose the job id
        added.append(satellite)
        logger.info("satellite job %s: servers %s join job %s", satellite.job_id, satellite.indices, main_job)
    return added


def wait_until(done: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 1.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout_s:.0f}s")
        time.sleep(poll_s)


def shrink(run_dir: Path, nodes: int, drain_timeout_s: float, stop_timeout_s: float = 120) -> list[Satellite]:
    satellites = read_satellites(run_dir)
    if nodes > len(satellites):
        raise ValueError(
            f"{run_dir} has {len(satellites)} satellite node(s): only rollout nodes added by launch.scale can be "
            "released (the job's own are part of its allocation)"
        )
    leaving = sorted(satellites, key=lambda s: s.first_index)[len(satellites) - nodes :]
    indices = sorted((i for s in leaving for i in s.indices), reverse=True)
    for index in indices:  # highest first, as launch.local drains
        discovery.request_drain(run_dir, index)
    logger.info("draining servers %s: they get no new request", indices)
    wait_until(
        lambda: all(discovery.is_drained(run_dir, i) for i in indices),
        drain_timeout_s,
        f"servers {indices} not drained (see logs/controller.log; their drain markers stay)",
    )
    for satellite in leaving:
        signal_batch_script(satellite.job_id, "TERM")
        try:
            wait_until(
                lambda s=satellite: job_state(s.job_id) == "",
                stop_timeout_s,
                f"job {satellite.job_id} still queued",
            )
        except TimeoutError:
            logger.warning("satellite %s did not stop on TERM: scancel", satellite.job_id)
            cancel_quietly(satellite.job_id)
        for index in satellite.indices:  # a server SIGKILLed at the end cannot unregister itself
            discovery.unregister_server(run_dir, index)
        satellites.remove(satellite)
        write_satellites(run_dir, satellites)
        logger.info(
            "satellite job %s released: servers %s drained, none of their requests in flight",
            satellite.job_id,
            satellite.indices,
        )
    return leaving


def rollout_nodes(run_dir: Path) -> int:
    """Rollout nodes the run has now: the job's own plus its satellites."""
    return plan_job(load_job_config(run_dir / "config.yaml")).rollout_nodes + len(read_satellites(run_dir))
