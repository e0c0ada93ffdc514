"""The trainer process: one per trainer rank; rank 0 talks to the controller.

    python -m areal_jobs.trainer.main --config RUN_DIR/config.yaml

Setup (resuming from RUN_DIR/checkpoints/latest when present), then `TrainLoop` until
trainer.total_steps, checkpointing every checkpoint.every_steps, then Stop: the controller runs
the final evaluation; rank 0 writes summary.json, the reward/accuracy PNG and a final Hugging
Face checkpoint. SIGUSR1/SIGTERM: checkpoint at the last finished step and exit 0 (SLURM
requeues; the next attempt resumes). Any failure on any rank exits every rank non-zero.

Several ranks (trainer=megatron, one process per GPU, RANK/WORLD_SIZE/MASTER_* from the launcher):
every rank sets up the backend; rank 0 runs all of the above and announces each collective call
(train step, weight broadcast, checkpoint, save_hf) to the others, which follow (trainer/ranks.py).
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
from areal_jobs.config import JobConfig, TrainerBackend, load_job_config
from areal_jobs.logs import setup_logging
from areal_jobs.metrics import build_sink
from areal_jobs.report import final_line, plot_run, write_summary
from areal_jobs.trainer import checkpoint as ckpt
from areal_jobs.trainer import ranks, session
from areal_jobs.trainer.loop import Preempted, TrainLoop
from areal_jobs.transport import messages as m
from areal_jobs.weights.publisher import StageSender, WeightPublisher, gather_senders

logger = logging.getLogger("areal_jobs.trainer.main")


def start_ranks(cfg: JobConfig) -> ranks.RankChannel:
    """Megatron: join the trainer's process group first, on every rank (before ZeroMQ or anything)."""
    if cfg.trainer.backend is not TrainerBackend.megatron:
        return ranks.RankChannel.single()
    from areal_jobs.trainer.megatron_backend import init_distributed

    init_distributed(cfg.trainer)
    return ranks.RankChannel.join(ranks.command_timeout_s(cfg))


def build_backend(cfg: JobConfig):
    model_path = cfg.model.path or cfg.model.builtin_dir
    if cfg.trainer.backend is TrainerBackend.megatron:
        from areal_jobs.trainer.megatron_backend import MegatronBackend

        return MegatronBackend(cfg.trainer, cfg.algo, model_path, cfg.model.dtype)
    from areal_jobs.trainer.torch_backend import TorchBackend

    return TorchBackend(cfg.trainer, cfg.algo, model_path, cfg.model.dtype)


def run(cfg: JobConfig, run_dir: Path, token: str) -> dict | None:
    """Every rank sets up; then rank 0 leads and the others follow it until Stop."""
    import torch

    preempt = threading.Event()  # SIGUSR1/SIGTERM never kill a rank: rank 0 decides what they mean
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda *_: preempt.set())
    torch.set_num_threads(cfg.trainer.threads)
    channel = start_ranks(cfg)
    backend = build_backend(cfg)
    backend.setup()
    stage = StageSender.create(
        cfg.weight_sync, backend, channel.rank // (cfg.trainer.tp_size * cfg.trainer.dp_size)
    )
    senders = gather_senders(channel, stage)  # Megatron rank order: tp fastest, then dp, then pp
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
    """Rank 0: the controller session, the TrainLoop, checkpoints and the end-of-run outputs."""
    from tqdm import tqdm

    t_start = float(os.environ.get("AREAL_JOB_START_TIME", time.time()))
    inbox = session.connect(cfg, run_dir, token)
    publisher = WeightPublisher(cfg.weight_sync, inbox, backend.channel, stage, senders, run_dir / "weights")
    latest = ckpt.latest_checkpoint(run_dir) if cfg.checkpoint.resume else None
    if latest is not None:  # before the sink opens metrics.jsonl: rows past the checkpoint go
        ckpt.truncate_jsonl(run_dir / "metrics.jsonl", ckpt.read_meta(latest)["step"])
    sink = build_sink(run_dir, cfg.run.tensorboard)
    loop = TrainLoop(
        cfg.algo, backend, inbox, publisher, sink, run_dir / "ledger.jsonl", cfg.trainer.batch_wait_timeout_s
    )
    loop.preempt = preempt
    if latest is not None:
        session.restore(run_dir, latest, loop, inbox)
    inbox.channel.send(m.TrainerHello(version=loop.version, step=loop.step, resumed=latest is not None))
    inbox.wait_for(m.ControllerHello, cfg.weight_sync.step_timeout_s * 5, "saying hello to the controller")
    if latest is not None:  # the servers restarted with the base model: give them this version first
        publisher.publish(loop.version, backend, trained=())
    every, timeout_s = cfg.checkpoint.every_steps, cfg.weight_sync.step_timeout_s
    saved_step = loop.step if latest is not None else -1
    try:
        steps = range(loop.step, cfg.trainer.total_steps)
        for _ in tqdm(steps, desc="train", unit="step", mininterval=5.0, disable=None):
            loop.run_step()
            if every and loop.step % every == 0 and loop.step < cfg.trainer.total_steps:
                session.save_checkpoint(run_dir, loop, inbox, cfg.checkpoint.keep_last, timeout_s)
                saved_step = loop.step
            if preempt.is_set():
                raise Preempted()
    except Preempted:
        logger.info("preempted after step %d: checkpointing", loop.step)
        if saved_step != loop.step:
            session.save_checkpoint(run_dir, loop, inbox, cfg.checkpoint.keep_last, timeout_s)
        else:  # the periodic checkpoint of this very step stands
            logger.info("checkpoint saved at step %d (periodic)", loop.step)
        inbox.channel.send(m.Stop(reason="preempted", final_eval=False))
        inbox.wait_for(m.Stopped, timeout_s, "the controller stopping after preemption")
        inbox.channel.close()
        return None
    inbox.channel.send(m.Stop(reason="trainer.total_steps reached"))
    stopped = inbox.wait_for(m.Stopped, cfg.rollout.request_timeout_s + 600, "the final evaluation")
    loop.log_evals()
    backend.save_hf(str(run_dir / "final_hf"))
    sink.close()
    publisher.close()
    inbox.channel.close()
    summary = session.summary(cfg, run_dir, loop, inbox, stopped, latest is not None, t_start)
    write_summary(run_dir, summary)
    plot_run(run_dir)
    logger.info(final_line(summary))
    return summary


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
    if cfg.trainer.backend is TrainerBackend.megatron:
        from areal_jobs.trainer.megatron_backend import shutdown_distributed

        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
