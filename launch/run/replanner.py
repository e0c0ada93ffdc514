"""Online re-planning beside a running job: the run's own measurements into the allocation planner.

Every `cluster.replan_every_steps` trained steps the re-planner reads what the last window of
steps measured in RUN_DIR/metrics.jsonl (the trainer's rows carry the controller's rollout stats):

    decode tok/s per rollout GPU  rollout/gen_tokens_per_s / (rollout/servers_up x GPUs per server),
                                  at rollout/requests_in_flight / the same GPUs (rows where it ran)
    train tok/s per trainer GPU   throughput/train_tokens_per_s (prompt + output tokens per second
                                  of the train step) / trainer GPUs
    answer lengths                gen/len_log_* (areal_jobs/data/answer_lengths.py), gen/prompt_len_mean
    weight sync                   time/publish_s

builds a `Measurement`, runs `launch.planning.replanning.replan.replan` on `cluster.allocation_profile` shaped like the
job, and appends `plan/recommended_rollout_fraction`, `plan/expected_gain` (and what it measured)
to the same metrics.jsonl, with one log line. With `cluster.autoscale=true` it also asks
launch/planning/replanning/autoscale.py how many rollout nodes the job should have and hands a change to `act`:
launch.local writes scale.json (launch/run/elastic.py starts or drains servers), a SLURM job's
re-planner submits or releases satellite jobs of rollout nodes, as `make scale ROLLOUT_NODES=+N`
does (launch/slurm/satellites.py).

    python -m launch.run.replanner runs/<name>      # the job script starts it on the batch host
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from areal_jobs.config import ClusterConfig, JobConfig
from areal_jobs.data.answer_lengths import LengthStats
from areal_jobs.metrics import MetricsSink
from launch.planning.replanning.autoscale import ScaleDecision, pool_throughput, scale_decision
from launch.planning.replanning.replan import Measurement, Recommendation, measured_profile, replan
from launch.planning.sim.profile import SimProfile, load_profile

logger = logging.getLogger("launch.run.replanner")


@dataclass(frozen=True)
class PoolShape:
    """The job as the re-planner counts it. Local: a server is a one-GPU rollout node, a trainer
    rank a one-GPU trainer node."""

    trainer_nodes: int
    trainer_gpus: int
    gpus_per_node: int
    servers_per_node: int
    gpus_per_server: int


class RunMetrics:
    """Appends plan/* rows to the run's metrics.jsonl, one open-write-close per row: the trainer
    replaces the file when it resumes (truncate_jsonl), so a handle held open could write into the
    replaced copy. One O_APPEND write per row keeps rows whole beside the trainer's own."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        pass


def measure(rows: list[dict[str, float]], rollout_fraction: float, shape: PoolShape) -> Measurement | None:
    """The window's Measurement; None when some quantity was not measured in it."""
    gen = [
        (r["rollout/gen_tokens_per_s"] / gpus, r["rollout/requests_in_flight"] / gpus)
        for r in rows
        if (gpus := r.get("rollout/servers_up", 0.0) * shape.gpus_per_server) > 0
        and r.get("rollout/gen_tokens_per_s", 0.0) > 0
        and r.get("rollout/requests_in_flight", 0.0) > 0
    ]
    train = [
        r["throughput/train_tokens_per_s"] for r in rows if r.get("throughput/train_tokens_per_s", 0) > 0
    ]
    stats = LengthStats.from_metrics(rows)
    if not gen or not train or stats is None:
        return None
    sync = [r["time/publish_s"] for r in rows if "time/publish_s" in r]
    prompts = [r["gen/prompt_len_mean"] for r in rows if "gen/prompt_len_mean" in r]
    tokens_per_s, batch = np.mean(np.asarray(gen), axis=0)
    return Measurement(
        rollout_fraction=rollout_fraction,
        gen_tokens_per_s_per_gpu=float(tokens_per_s),
        gen_batch_per_gpu=float(batch),
        train_tokens_per_s_per_gpu=float(np.mean(train)) / shape.trainer_gpus,
        length_stats=stats,
        weight_sync_s=float(np.mean(sync)) if sync else None,
        prompt_tokens=float(np.mean(prompts)) if prompts else None,
    )


class Replanner:
    """Fed the metrics rows as they appear (`observe`); re-plans every `every_steps` step rows.

    `rollout_nodes()` is the pool asked for now (it changes with autoscale and `make scale`);
    `act(decision)` carries out an autoscale change, None = re-plan and log only."""

    def __init__(
        self,
        base: SimProfile,
        shape: PoolShape,
        every_steps: int,
        rollout_nodes: Callable[[], int],
        sink: MetricsSink,
        cluster: ClusterConfig,
        act: Callable[[ScaleDecision], None] | None = None,
    ) -> None:
        self.base = base
        self.shape = shape
        self.every_steps = every_steps
        self.rollout_nodes = rollout_nodes
        self.sink = sink
        self.max_nodes = cluster.autoscale_max_nodes
        self.min_gain = cluster.autoscale_min_gain
        self.act = act
        self.window: list[dict[str, float]] = []
        self.last: tuple[Recommendation, ScaleDecision | None] | None = None

    def observe(self, rows: list[dict[str, float]]) -> None:
        for row in rows:
            if "train/version" not in row:  # evaluations, plan/* rows
                continue
            self.window.append(row)
            if len(self.window) >= self.every_steps:
                window, self.window = self.window, []
                try:
                    self._replan(window)
                except ValueError as exc:  # a profile check on odd measurements: keep the run going
                    logger.warning("re-plan at step %d skipped: %s", int(window[-1]["step"]), exc)

    def _replan(self, window: list[dict[str, float]]) -> None:
        t0, step = time.monotonic(), int(window[-1]["step"])
        s, nodes = self.shape, self.rollout_nodes()
        fraction = nodes / (nodes + s.trainer_nodes)
        m = measure(window, fraction, s)
        if m is None:
            logger.info("re-plan at step %d skipped: the window measured no generation or training", step)
            return
        base = self._profile(nodes)
        rec = replan(base, m)
        decision = None
        # decide only on a window that ran the pool asked for: a joining or draining server skews it
        settled = all(r.get("rollout/servers_up") == nodes * s.servers_per_node for r in window)
        if self.act is not None and settled:
            throughput = pool_throughput(measured_profile(base, m), s.trainer_nodes, nodes)
            decision = scale_decision(throughput, s.trainer_nodes, nodes, self.max_nodes, self.min_gain)
        metrics = {
            **rec.metrics(),
            "plan/current_rollout_fraction": rec.current_fraction,
            "plan/gen_tokens_per_s_per_gpu": m.gen_tokens_per_s_per_gpu,
            "plan/gen_batch_per_gpu": m.gen_batch_per_gpu,
            "plan/train_tokens_per_s_per_gpu": m.train_tokens_per_s_per_gpu,
            "plan/answer_median_tokens": math.exp(m.lengths.log_mean),
            "plan/replan_s": time.monotonic() - t0,
            **(decision.metrics() if decision else {}),
        }
        self.sink.log(step, metrics)
        logger.info(
            "re-plan at step %d: decode %.0f tok/s per rollout GPU at batch %.1f, training %.0f tok/s "
            "per trainer GPU, answers median %.0f tokens -> rollout fraction %.3f recommended (now %.3f), "
            "expected gain x%.3f (%.2fs)",
            step, m.gen_tokens_per_s_per_gpu, m.gen_batch_per_gpu, m.train_tokens_per_s_per_gpu,
            metrics["plan/answer_median_tokens"], rec.rollout_fraction, rec.current_fraction,
            rec.expected_gain, metrics["plan/replan_s"],
        )  # fmt: skip
        if self.act is not None and not settled:
            logger.info("autoscale: the pool is changing (asked for %d rollout nodes); no decision", nodes)
        if decision is not None:
            logger.info("autoscale at step %d: %s", step, decision.reason)
            if decision.change:
                self.act(decision)
        self.last = (rec, decision)

    def _profile(self, rollout_nodes: int) -> SimProfile:
        p = copy.deepcopy(self.base)
        p.cluster.nodes = rollout_nodes + self.shape.trainer_nodes
        p.cluster.rollout_fraction = rollout_nodes / p.cluster.nodes
        p.__post_init__()
        return p


def job_profile(job: JobConfig, shape: PoolShape) -> SimProfile:
    """`cluster.allocation_profile` with the job's algo and rollout settings and GPU counts; the
    node count is set per re-plan (the pool changes)."""
    p = load_profile(job.cluster.allocation_profile)
    p.cluster.gpus_per_node = shape.gpus_per_node
    p.cluster.rollout_tp = shape.gpus_per_server
    p.algo.batch_size = job.algo.batch_size
    p.algo.group_size = job.algo.group_size
    p.algo.max_staleness = job.algo.max_staleness
    p.algo.max_concurrent = max(job.rollout.max_concurrent, job.algo.group_size)
    p.lengths.max_tokens = job.rollout.max_new_tokens
    p.lengths.min_tokens = min(p.lengths.min_tokens, job.rollout.max_new_tokens)
    p.lengths.median_tokens = min(p.lengths.median_tokens, p.lengths.max_tokens)
    return p


def local_shape(job: JobConfig) -> PoolShape:
    t = job.trainer
    ranks = 1 if t.backend.value == "torch" else t.tp_size * t.pp_size * t.dp_size
    return PoolShape(
        trainer_nodes=ranks, trainer_gpus=ranks, gpus_per_node=1, servers_per_node=1, gpus_per_server=1
    )


def local_replanner(job: JobConfig, run_dir: Path) -> Replanner | None:
    """launch.local's re-planner (None with cluster.replan_every_steps=0). Its pool is the servers
    asked for (scale.json, else rollout.num_servers); autoscale writes scale.json, as `make scale`."""
    from launch.run.elastic import read_target, write_target

    c = job.cluster
    if not c.replan_every_steps:
        return None
    shape = local_shape(job)

    def servers() -> int:
        return read_target(run_dir) or job.rollout.num_servers

    def scale(d: ScaleDecision) -> None:
        logger.info(
            "autoscale: %d -> %d rollout servers (launch.scale writes the same)",
            d.current_nodes,
            d.target_nodes,
        )
        write_target(run_dir, d.target_nodes)

    sink = RunMetrics(run_dir / "metrics.jsonl")
    return Replanner(
        job_profile(job, shape), shape, c.replan_every_steps, servers, sink, c, scale if c.autoscale else None
    )


def slurm_shape(job: JobConfig) -> tuple[PoolShape, int]:
    """(shape, rollout nodes) from the job's plan; whole-node layouts only."""
    from launch.planning.layout.plan import plan_job

    plan = plan_job(job)
    if plan.rollout_nodes < 1 or plan.trainer_nodes < 1:
        raise ValueError("re-planning a SLURM job counts whole nodes: it needs cluster.placement=nodes")
    trainer_gpus = plan.trainer_tp * plan.trainer_pp * plan.trainer_dp
    shape = PoolShape(
        plan.trainer_nodes, trainer_gpus, plan.gpus_per_node, plan.servers_per_node, plan.rollout_tp
    )
    return shape, plan.rollout_nodes


def main(argv: list[str] | None = None) -> int:
    """Follow a SLURM job's metrics.jsonl until summary.json appears; log and record each re-plan,
    and with cluster.autoscale=true carry out a change with satellite jobs. The pool it counts is
    the job's plan plus its satellites (RUN_DIR/satellites.json, also those added by `make scale`)."""
    from areal_jobs.config import load_job_config
    from areal_jobs.logs import setup_logging
    from areal_jobs.metrics import read_jsonl
    from launch.slurm import satellites as scale_slurm
    from launch.slurm.cli import SlurmError

    p = argparse.ArgumentParser(prog="python -m launch.run.replanner", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path, help="the job's run directory (runs/<run.name>)")
    p.add_argument("--poll-s", type=float, default=10.0, help="how often to read metrics.jsonl")
    p.add_argument("--from-start", action="store_true", help="re-plan the steps already logged too")
    p.add_argument(
        "--drain-timeout-s", type=float, default=900.0, help="autoscale shrink: longest wait for the drain"
    )
    args = p.parse_args(argv)
    setup_logging("launch")
    job = load_job_config(args.run_dir / "config.yaml")
    if not job.cluster.replan_every_steps:
        p.error("cluster.replan_every_steps=0 in this job's config: re-planning is off")
    try:
        shape, _ = slurm_shape(job)
    except ValueError as exc:
        p.error(str(exc))

    def rollout_nodes() -> int:
        return scale_slurm.rollout_nodes(args.run_dir)  # the job's own + its satellites

    def act(d: ScaleDecision) -> None:
        """Satellite jobs, as `make scale RUN=... ROLLOUT_NODES=+N/-N` (launch/slurm/satellites.py); only
        satellites can be released, so a shrink stops at the job's own rollout nodes."""
        change = d.change
        if change < 0:
            change = -min(-change, len(scale_slurm.read_satellites(args.run_dir)))
            if change != d.change:
                logger.info(
                    "autoscale: %d rollout nodes wanted, but only satellites can be released (%d of them)",
                    d.target_nodes, -change,
                )  # fmt: skip
        if not change:
            return
        logger.info(
            "autoscale: %d -> %d rollout nodes (make scale RUN=%s ROLLOUT_NODES=%+d)",
            d.current_nodes, d.current_nodes + change, args.run_dir, change,
        )  # fmt: skip
        try:
            if change > 0:
                scale_slurm.grow(args.run_dir, change)
            else:
                scale_slurm.shrink(args.run_dir, -change, args.drain_timeout_s)
        except (ValueError, SlurmError, TimeoutError) as exc:
            logger.warning("autoscale: the change failed (%s); the job goes on with what it has", exc)

    sink = RunMetrics(args.run_dir / "metrics.jsonl")
    replanner = Replanner(
        job_profile(job, shape), shape, job.cluster.replan_every_steps, rollout_nodes, sink, job.cluster,
        act if job.cluster.autoscale else None,
    )  # fmt: skip
    seen = 0 if args.from_start else len(read_jsonl(args.run_dir / "metrics.jsonl"))
    while True:
        done = (args.run_dir / "summary.json").exists()  # before the last read: no row is missed
        rows = read_jsonl(args.run_dir / "metrics.jsonl")
        replanner.observe(rows[seen:])
        seen = len(rows)
        if done:
            break
        time.sleep(args.poll_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
