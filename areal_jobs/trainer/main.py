"""The trainer process (rank 0 of the trainer group talks to the controller).

    python -m areal_jobs.trainer.main --config RUN_DIR/config.yaml

Setup, then `TrainLoop` until trainer.total_steps, then Stop: the controller runs the final
evaluation; this process writes summary.json, the reward/accuracy PNG and a final Hugging Face
checkpoint. Exits non-zero on any failure (a failed or timed-out stage is named in the log).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from areal_jobs.config import JobConfig, TrainerBackend, load_job_config
from areal_jobs.logs import setup_logging
from areal_jobs.metrics import build_sink
from areal_jobs.report import final_line, plot_run, write_summary
from areal_jobs.rollout import discovery
from areal_jobs.trainer.inbox import Inbox
from areal_jobs.trainer.loop import TrainLoop
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


def run(cfg: JobConfig, run_dir: Path, token: str) -> dict:
    import torch

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
    inbox.channel.send(m.TrainerHello(version=0, step=0))
    inbox.wait_for(m.ControllerHello, cfg.weight_sync.step_timeout_s * 5, "saying hello to the controller")
    bind = os.environ.get("AREAL_BIND_HOST", "127.0.0.1")
    port = cfg.weight_sync.master_port or discovery.free_port(bind)
    publisher = WeightPublisher(cfg.weight_sync, inbox, bind, port, run_dir / "weights")
    sink = build_sink(run_dir, cfg.run.tensorboard)
    loop = TrainLoop(cfg.algo, backend, inbox, publisher, sink, run_dir / "ledger.jsonl", cfg.trainer.batch_wait_timeout_s)
    from tqdm import tqdm

    for _ in tqdm(range(cfg.trainer.total_steps), desc="train", unit="step", mininterval=5.0, disable=None):
        loop.run_step()
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
        "final_checkpoint": str(run_dir / "final_hf"),
    }
    write_summary(run_dir, summary)
    plot_run(run_dir)
    logger.info(final_line(summary))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
