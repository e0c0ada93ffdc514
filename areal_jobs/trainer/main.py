"""The trainer process: one per trainer rank; rank 0 talks to the controller.

    python -m areal_jobs.trainer.main --config RUN_DIR/config.yaml

Every rank: join the ranks, set up the backend, the weight sender of its pipeline stage. Rank 0
then leads: the controller session (resuming from RUN_DIR/checkpoints/latest when present),
`TrainLoop` steps until trainer.total_steps with a checkpoint every checkpoint.every_steps, and the
end-of-run outputs (session.finish). It announces every collective call to the other ranks, which
follow (trainer/dist/ranks.py). SIGUSR1/SIGTERM: checkpoint at the last finished step and exit 0 (SLURM
requeues; the next attempt resumes). Any failure on any rank exits every rank non-zero.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from areal_jobs.api import WeightSender
from areal_jobs.config import JobConfig, LoraShip, load_job_config, serving_dtype
from areal_jobs.logs import setup_logging
from areal_jobs.trainer import backends, session
from areal_jobs.trainer.dist import gpu_memory, ranks
from areal_jobs.trainer.loop import Preempted
from areal_jobs.trainer.publish.publisher import WeightPublisher, gather_senders
from areal_jobs.weights.broadcast import gpu_available
from areal_jobs.weights.sender import StageSender

logger = logging.getLogger("areal_jobs.trainer.main")


def run(cfg: JobConfig, run_dir: Path, token: str) -> dict | None:
    """Every rank sets up; then rank 0 leads and the others follow it until Stop."""
    import torch

    preempt = threading.Event()  # SIGUSR1/SIGTERM never kill a rank: rank 0 decides what they mean
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda *_: preempt.set())
    torch.set_num_threads(cfg.trainer.threads)
    gpu_memory.limit(cfg)  # the planner's share, where the GPU is shared with rollout servers
    channel = backends.join_ranks(cfg)
    backend = backends.build_backend(cfg)
    backend.setup()
    # the servers' dtype (rollout.dtype): every tensor is sent rounded to it, masters stay as they are
    dtype = serving_dtype(cfg.rollout.dtype, cfg.model.dtype, gpu=gpu_available())
    stage = StageSender.create(cfg.weight_sync, backend, backends.pipeline_stage(cfg, channel.rank), dtype)
    senders = gather_senders(channel, stage)
    if channel.rank > 0:
        ranks.follow(channel, backend, stage, preempt)
        return None
    try:
        summary = lead(cfg, run_dir, token, ranks.LeaderBackend(backend, channel), stage, senders, preempt)
    except BaseException as exc:
        channel.abort(f"{type(exc).__name__}: {exc}")
        raise
    channel.send(ranks.Stop())
    return summary


def lead(cfg: JobConfig, run_dir: Path, token: str, backend: ranks.LeaderBackend, stage: StageSender,
         senders: tuple[WeightSender, ...], preempt: threading.Event) -> dict | None:  # fmt: skip
    """Rank 0: the controller session, the TrainLoop with its checkpoints, then the outputs."""
    from tqdm import tqdm

    t_start = float(os.environ.get("AREAL_JOB_START_TIME", time.time()))
    inbox = session.connect(cfg, run_dir, token)
    adapters = run_dir / "weights" / "lora" if cfg.model.lora.ship is LoraShip.adapter else None
    publisher = WeightPublisher(
        cfg.weight_sync, inbox, backend.channel, stage, senders, run_dir / "weights", adapters,
        update_deadline_s=cfg.control.update_deadline_s,
    )  # fmt: skip
    loop, resumed = session.open_loop(cfg, run_dir, backend, inbox, publisher, preempt)
    saved_step = loop.step if resumed else -1
    try:
        steps = range(loop.step, cfg.trainer.total_steps)
        for _ in tqdm(steps, desc="train", unit="step", mininterval=5.0, disable=None):
            loop.run_step()
            if session.checkpoint_due(cfg, loop.step):
                session.save_checkpoint(cfg, run_dir, loop)
                saved_step = loop.step
            if preempt.is_set():
                raise Preempted()
    except Preempted:
        session.stop_preempted(cfg, run_dir, loop, checkpointed=saved_step == loop.step)
        return None
    return session.finish(cfg, run_dir, loop, resumed, t_start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="resolved run config (RUN_DIR/config.yaml)")
    args = parser.parse_args(argv)
    setup_logging("trainer")
    cfg = load_job_config(args.config)
    token = os.environ.get("AREAL_JOB_TOKEN") or cfg.run.token
    if not token:
        raise SystemExit("no job token: set AREAL_JOB_TOKEN (the launcher does) or run.token")
    try:
        run(cfg, Path(args.config).resolve().parent, token)
    except Exception:
        logger.exception("trainer failed")
        ranks.exit_now(1)  # several ranks: a collective left pending must not block the exit
        return 1
    backends.leave_ranks(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
