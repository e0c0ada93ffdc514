"""The trainer process (rank 0 of the trainer group talks to the controller).

    python -m areal_jobs.trainer.main --config RUN_DIR/config.yaml

Setup (resuming from RUN_DIR/checkpoints/latest when present), then `TrainLoop` until
trainer.total_steps, checkpointing every checkpoint.every_steps, then Stop: the controller runs
the final evaluation; this process writes summary.json, the reward/accuracy PNG and a final
Hugging Face checkpoint. SIGUSR1/SIGTERM: checkpoint at the last finished step and exit 0
(SLURM requeues; the next attempt resumes). Any failure exits non-zero, naming the stage.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

from areal_jobs.config import JobConfig, TrainerBackend, load_job_config
from areal_jobs.logs import setup_logging
from areal_jobs.metrics import build_sink
from areal_jobs.report import final_line, plot_run, write_summary
from areal_jobs.rollout import discovery
from areal_jobs.trainer import checkpoint as ckpt
from areal_jobs.trainer.inbox import Inbox
from areal_jobs.trainer.loop import Preempted, TrainLoop
from areal_jobs.transport import messages as m
from areal_jobs.transport.channels import TrainerChannel
from areal_jobs.weights.publisher import WeightPublisher

logger = logging.getLogger("areal_jobs.trainer.main")


def build_backend(cfg: JobConfig):
    model_path = cfg.model.path or cfg.model.builtin_dir
    if cfg.trainer.backend is TrainerBackend.megatron:
        from areal_jobs.trainer.megatron_backend import MegatronBackend

        return MegatronBackend(cfg.trainer, cfg.algo, model_path, cfg.model.dtype)
    from areal_jobs.trainer.torch_backend import TorchBackend

    return TorchBackend(cfg.trainer, cfg.algo, model_path, cfg.model.dtype)


def save_checkpoint(run_dir: Path, loop: TrainLoop, inbox: Inbox, keep_last: int, timeout_s: float) -> None:
    """Both halves of a consistent cut at step `loop.step`; generation keeps running meanwhile."""
    t0 = time.monotonic()
    folder = ckpt.step_dir(run_dir, loop.step)
    inbox.channel.send(
        m.CheckpointRequest(step=loop.step, version=loop.version, path=str(folder / "rollout"))
    )
    loop.backend.save_checkpoint(str(folder / "trainer"))
    saved = inbox.wait_for(m.CheckpointSaved, timeout_s, f"the controller saving checkpoint step {loop.step}")
    evals = [vars_of(e) for e in inbox.all_evals]
    ckpt.commit(run_dir, folder, {**loop.state_dict(), "evals": evals}, keep_last)
    logger.info(
        "checkpoint saved at step %d in %.1fs (%d untrained groups, %d partial samples)",
        loop.step, time.monotonic() - t0, saved.num_groups, saved.num_partial_samples,
    )  # fmt: skip


def vars_of(ev: m.EvalResult) -> dict:
    return {"version": ev.version, "accuracy": ev.accuracy, "mean_reward": ev.mean_reward,
            "num_prompts": ev.num_prompts, "kind": ev.kind}  # fmt: skip


def run(cfg: JobConfig, run_dir: Path, token: str) -> dict | None:
    import torch
    from tqdm import tqdm

    t_start = float(os.environ.get("AREAL_JOB_START_TIME", time.time()))
    torch.set_num_threads(cfg.trainer.threads)
    backend = build_backend(cfg)
    backend.setup()
    host = os.environ.get("AREAL_CONTROLLER_HOST")
    if host and cfg.rollout.controller_port:
        ports = (cfg.rollout.controller_port, cfg.rollout.controller_port + 1)
    else:
        host, *ports = discovery.wait_for_controller(run_dir, cfg.rollout.server_start_timeout_s + 600)
    inbox = Inbox(TrainerChannel(host, ports[0], ports[1], token).connect())
    bind = os.environ.get("AREAL_BIND_HOST", "127.0.0.1")
    port = cfg.weight_sync.master_port or discovery.free_port(bind)
    publisher = WeightPublisher(cfg.weight_sync, inbox, bind, port, run_dir / "weights")
    latest = ckpt.latest_checkpoint(run_dir) if cfg.checkpoint.resume else None
    if latest is not None:  # before the sink opens metrics.jsonl: rows past the checkpoint go
        ckpt.truncate_jsonl(run_dir / "metrics.jsonl", ckpt.read_meta(latest)["step"])
    sink = build_sink(run_dir, cfg.run.tensorboard)
    loop = TrainLoop(
        cfg.algo, backend, inbox, publisher, sink, run_dir / "ledger.jsonl", cfg.trainer.batch_wait_timeout_s
    )
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda *_: loop.preempt.set())
    if latest is not None:
        meta = ckpt.read_meta(latest)
        backend.load_checkpoint(str(latest / "trainer"))
        loop.load_state_dict(meta)
        inbox.all_evals = [m.EvalResult(**e) for e in meta.get("evals", [])]
        dropped = ckpt.truncate_jsonl(run_dir / "ledger.jsonl", loop.step)
        logger.info(
            "resumed from checkpoint at step %d (version %d; %d later ledger rows dropped)",
            loop.step,
            loop.version,
            dropped,
        )
    inbox.channel.send(m.TrainerHello(version=loop.version, step=loop.step, resumed=latest is not None))
    inbox.wait_for(m.ControllerHello, cfg.weight_sync.step_timeout_s * 5, "saying hello to the controller")
    if latest is not None:  # the servers restarted with the base model: give them this version first
        publisher.publish(loop.version, backend, trained=())
    every = cfg.checkpoint.every_steps
    timeout_s = cfg.weight_sync.step_timeout_s
    saved_step = loop.step if latest is not None else -1
    try:
        for _ in tqdm(
            range(loop.step, cfg.trainer.total_steps),
            desc="train",
            unit="step",
            mininterval=5.0,
            disable=None,
        ):
            loop.run_step()
            if every and loop.step % every == 0 and loop.step < cfg.trainer.total_steps:
                save_checkpoint(run_dir, loop, inbox, cfg.checkpoint.keep_last, timeout_s)
                saved_step = loop.step
            if loop.preempt.is_set():
                raise Preempted()
    except Preempted:
        logger.info("preempted after step %d: checkpointing", loop.step)
        if saved_step != loop.step:
            save_checkpoint(run_dir, loop, inbox, cfg.checkpoint.keep_last, timeout_s)
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
    evals = {ev.kind: ev.accuracy for ev in inbox.all_evals}
    summary = {
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
        "resumed": latest is not None,
        "final_checkpoint": str(run_dir / "final_hf"),
    }
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
        return 0
    except Exception:
        logger.exception("trainer failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
