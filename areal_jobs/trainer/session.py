"""Trainer rank 0's session with the rollout controller: connect, resume, checkpoint, summarise.

The pieces of `trainer/main.py` that talk to the controller or the run directory, so that the
driver reads like the algorithm. Every wait is bounded and names what it waited for.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from areal_jobs.config import JobConfig
from areal_jobs.rollout import discovery
from areal_jobs.trainer import checkpoint as ckpt
from areal_jobs.trainer.inbox import Inbox
from areal_jobs.trainer.loop import TrainLoop
from areal_jobs.transport import messages as m
from areal_jobs.transport.channels import TrainerChannel

logger = logging.getLogger(__name__)


def connect(cfg: JobConfig, run_dir: Path, token: str) -> Inbox:
    """The controller's address from the environment (SLURM) or RUN_DIR/controller.json (local)."""
    host = os.environ.get("AREAL_CONTROLLER_HOST")
    if host and cfg.rollout.controller_port:
        ports = (cfg.rollout.controller_port, cfg.rollout.controller_port + 1)
    else:
        host, *ports = discovery.wait_for_controller(run_dir, cfg.rollout.server_start_timeout_s + 600)
    return Inbox(TrainerChannel(host, ports[0], ports[1], token).connect())


def restore(run_dir: Path, latest: Path, loop: TrainLoop, inbox: Inbox) -> None:
    """Model, optimiser and loop counters from `latest` (collective: every rank loads)."""
    meta = ckpt.read_meta(latest)
    loop.backend.load_checkpoint(str(latest / "trainer"))
    loop.load_state_dict(meta)
    inbox.all_evals = [m.EvalResult(**e) for e in meta.get("evals", [])]
    dropped = ckpt.truncate_jsonl(run_dir / "ledger.jsonl", loop.step)
    logger.info(
        "resumed from checkpoint at step %d (version %d; %d later ledger rows dropped)",
        loop.step, loop.version, dropped,
    )  # fmt: skip


def save_checkpoint(run_dir: Path, loop: TrainLoop, inbox: Inbox, keep_last: int, timeout_s: float) -> None:
    """Both halves of a consistent cut at step `loop.step`; generation keeps running meanwhile."""
    t0 = time.monotonic()
    folder = ckpt.step_dir(run_dir, loop.step)
    inbox.channel.send(
        m.CheckpointRequest(step=loop.step, version=loop.version, path=str(folder / "rollout"))
    )
    loop.backend.save_checkpoint(str(folder / "trainer"))
    saved = inbox.wait_for(m.CheckpointSaved, timeout_s, f"the controller saving checkpoint step {loop.step}")
    evals = [_eval_row(e) for e in inbox.all_evals]
    ckpt.commit(run_dir, folder, {**loop.state_dict(), "evals": evals}, keep_last)
    logger.info(
        "checkpoint saved at step %d in %.1fs (%d untrained groups, %d partial samples)",
        loop.step, time.monotonic() - t0, saved.num_groups, saved.num_partial_samples,
    )  # fmt: skip


def summary(cfg: JobConfig, run_dir: Path, loop: TrainLoop, inbox: Inbox, stopped: m.Stopped,
            resumed: bool, t_start: float) -> dict:  # fmt: skip
    """The content of summary.json."""
    evals = {ev.kind: ev.accuracy for ev in inbox.all_evals}
    return {
        "accuracy_start": evals.get("start"),
        "accuracy_end": evals.get("final"),
        "greedy_accuracy_start": evals.get("start_greedy"),
        "greedy_accuracy_end": evals.get("final_greedy"),
        "steps": loop.step,
        "wall_s": round(time.time() - t_start, 1),
        "max_staleness_seen": loop.max_staleness_seen,
        "interrupted_requests": int(stopped.metrics.get("rollout/interrupted_requests", 0)),
        "trained_tokens": loop.trained_tokens,
        "expired_groups": loop.expired_groups,
        "max_staleness": cfg.algo.max_staleness,
        "resumed": resumed,
        "final_checkpoint": str(run_dir / "final_hf"),
    }


def _eval_row(ev: m.EvalResult) -> dict:
    return {"version": ev.version, "accuracy": ev.accuracy, "mean_reward": ev.mean_reward,
            "num_prompts": ev.num_prompts, "kind": ev.kind}  # fmt: skip
