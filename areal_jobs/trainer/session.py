"""Trainer rank 0's session with the rollout controller: connect, resume, checkpoint, stop, finish.

The pieces of `trainer/main.py` that talk to the controller or the run directory, so that the
driver reads like the algorithm. Every wait is bounded and names what it waited for.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path

from omegaconf import OmegaConf

from areal_jobs import checkpoint as ckpt
from areal_jobs.api import TrainBackend
from areal_jobs.config import JobConfig, LoraFinal
from areal_jobs.data.tokenizer import load_tokenizer
from areal_jobs.metrics import build_sink, read_jsonl
from areal_jobs.report import final_line, length_table, plot_run, source_table, write_summary
from areal_jobs.samples import SampleDump, train_records
from areal_jobs.trainer.forward.lora import copy_tokenizer
from areal_jobs.trainer.intake.inbox import Inbox
from areal_jobs.trainer.loop import TrainLoop
from areal_jobs.trainer.objective.staleness_watch import PreclipWatch
from areal_jobs.trainer.publish.publisher import WeightPublisher
from areal_jobs.transport import discovery
from areal_jobs.transport import messages as m
from areal_jobs.transport.channels import TrainerChannel

logger = logging.getLogger(__name__)


def connect(cfg: JobConfig, run_dir: Path, token: str) -> Inbox:
    """The controller's address from the environment (SLURM) or RUN_DIR/controller.json (local)."""
    host = os.environ.get("AREAL_CONTROLLER_HOST")
    if host and cfg.rollout.controller_port:
        ports = (cfg.rollout.controller_port, cfg.rollout.controller_port + 1)
    else:
        start_s = max(cfg.rollout.server_start_timeout_s, cfg.control.server_start_deadline_s)
        host, *ports = discovery.wait_for_controller(run_dir, start_s + 600)
    return Inbox(TrainerChannel(host, ports[0], ports[1], token).connect(), cfg.control.peer_silence_s)


def open_loop(cfg: JobConfig, run_dir: Path, backend: TrainBackend, inbox: Inbox, publisher: WeightPublisher,
              preempt: threading.Event) -> tuple[TrainLoop, bool]:  # fmt: skip
    """The TrainLoop, resumed from RUN_DIR/checkpoints/latest when there is one (then True), after
    the hello exchange with the controller."""
    latest = ckpt.latest_checkpoint(run_dir) if cfg.checkpoint.resume else None
    if latest is not None:  # before the sink opens metrics.jsonl: rows past the checkpoint go
        ckpt.truncate_jsonl(run_dir / "metrics.jsonl", ckpt.read_meta(latest)["step"])
    sink = build_sink(run_dir, cfg.run.tensorboard, wandb_settings(cfg))
    loop = TrainLoop(
        cfg.algo,
        backend,
        inbox,
        publisher,
        sink,
        run_dir / "ledger.jsonl",
        cfg.trainer.batch_wait_timeout_s,
        cfg.rollout.max_new_tokens,
    )
    loop.preempt = preempt
    if cfg.run.preclip_warn_fraction > 0:
        loop.preclip_watch = PreclipWatch(
            cfg.run.preclip_warn_fraction, objective=cfg.algo.loss_objective.value
        )
    every = cfg.run.samples_every_steps
    if every > 0:
        dump = SampleDump(run_dir / "samples.jsonl", cfg.run.samples_print)
        decode = load_tokenizer(cfg.model.path or cfg.model.builtin_dir).decode_raw
        loop.dump_samples = lambda step, groups: (
            dump.write(train_records(step, groups, decode)) if step % every == 0 else None
        )
    if latest is not None:
        restore(run_dir, latest, loop, inbox)
    inbox.channel.send(m.TrainerHello(version=loop.version, step=loop.step, resumed=latest is not None))
    inbox.wait_for(m.ControllerHello, cfg.weight_sync.step_timeout_s * 5, "saying hello to the controller")
    if latest is not None:  # the servers restarted with the base model: give them this version first
        publisher.publish(loop.version, backend, trained=())
    return loop, latest is not None


def wandb_settings(cfg: JobConfig) -> dict | None:
    """WandbSink's arguments from logging.*, with the resolved config attached to the run."""
    if not cfg.logging.wandb:
        return None
    resolved = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    return {
        "project": cfg.logging.wandb_project,
        "name": cfg.logging.wandb_run_name or cfg.run.name,
        "group": cfg.logging.wandb_group,
        "mode": cfg.logging.wandb_mode.value,
        "config": resolved,
    }


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


def checkpoint_due(cfg: JobConfig, step: int) -> bool:
    """Every checkpoint.every_steps, except at the last step (the final outputs follow it)."""
    every = cfg.checkpoint.every_steps
    return bool(every) and step % every == 0 and step < cfg.trainer.total_steps


def save_checkpoint(cfg: JobConfig, run_dir: Path, loop: TrainLoop) -> None:
    """Both halves of a consistent cut at step `loop.step`; generation keeps running meanwhile."""
    # the controller writes its snapshot to the run directory: as slow as the file system is
    inbox, timeout_s = loop.inbox, max(cfg.weight_sync.step_timeout_s, cfg.control.load_deadline_s)
    t0 = time.monotonic()
    folder = ckpt.step_dir(run_dir, loop.step)
    inbox.channel.send(
        m.CheckpointRequest(step=loop.step, version=loop.version, path=str(folder / "rollout"))
    )
    loop.backend.save_checkpoint(str(folder / "trainer"))
    saved = inbox.wait_for(m.CheckpointSaved, timeout_s, f"the controller saving checkpoint step {loop.step}")
    evals = [_eval_row(e) for e in inbox.all_evals]
    ckpt.commit(run_dir, folder, {**loop.state_dict(), "evals": evals}, cfg.checkpoint.keep_last)
    logger.info(
        "checkpoint saved at step %d in %.1fs (%d untrained groups, %d partial samples)",
        loop.step, time.monotonic() - t0, saved.num_groups, saved.num_partial_samples,
    )  # fmt: skip


def stop_preempted(cfg: JobConfig, run_dir: Path, loop: TrainLoop, checkpointed: bool) -> None:
    """SIGUSR1/SIGTERM: a checkpoint at the last finished step (unless the periodic one is that
    step), then the controller stops without a final evaluation; SLURM requeues the job."""
    logger.info("preempted after step %d: checkpointing", loop.step)
    timeout_s = cfg.weight_sync.step_timeout_s
    if checkpointed:
        logger.info("checkpoint saved at step %d (periodic)", loop.step)
    else:
        save_checkpoint(cfg, run_dir, loop)
    loop.inbox.channel.send(m.Stop(reason="preempted", final_eval=False))
    loop.inbox.wait_for(m.Stopped, timeout_s, "the controller stopping after preemption")
    loop.inbox.channel.close()


def finish(cfg: JobConfig, run_dir: Path, loop: TrainLoop, resumed: bool, t_start: float) -> dict:
    """trainer.total_steps reached: the controller's final evaluation, the final Hugging Face
    checkpoint, summary.json, the reward/accuracy PNG and the one-line result."""
    inbox = loop.inbox
    inbox.channel.send(m.Stop(reason="trainer.total_steps reached"))
    stopped = inbox.wait_for(m.Stopped, cfg.rollout.request_timeout_s + 600, "the final evaluation")
    loop.log_evals()
    save_final(cfg, loop.backend, run_dir / "final_hf")
    loop.sink.close()
    loop.publisher.close()
    inbox.channel.close()
    result = summary(cfg, run_dir, loop, inbox, stopped, resumed, t_start)
    write_summary(run_dir, result)
    plot_run(run_dir, result)
    logger.info(final_line(result))
    if result["by_length"]:
        logger.info("held-out accuracy by chain length:\n%s", length_table(result["by_length"]))
    if result["by_source"]:
        logger.info("held-out accuracy by source:\n%s", source_table(result["by_source"]))
    return result


def save_final(cfg: JobConfig, backend: TrainBackend, folder: Path) -> None:
    """final_hf/: a plain HF model, or (model.lora.final_hf=adapter) a PEFT adapter directory
    naming the base model, with its tokenizer."""
    if cfg.model.lora.final_hf is LoraFinal.adapter:
        backend.save_adapter(str(folder))
        copy_tokenizer(Path(cfg.model.path or cfg.model.builtin_dir), folder)
    else:
        backend.save_hf(str(folder))


def summary(cfg: JobConfig, run_dir: Path, loop: TrainLoop, inbox: Inbox, stopped: m.Stopped,
            resumed: bool, t_start: float) -> dict:  # fmt: skip
    """The content of summary.json."""
    evals = {ev.kind: ev for ev in inbox.all_evals}
    acc = {kind: ev.accuracy for kind, ev in evals.items()}
    return {
        "accuracy_start": acc.get("start"),
        "accuracy_end": acc.get("final"),
        "greedy_accuracy_start": acc.get("start_greedy"),
        "greedy_accuracy_end": acc.get("final_greedy"),
        "pass_at_k_start": evals["start"].pass_at_k if "start" in evals else None,
        "pass_at_k_end": evals["final"].pass_at_k if "final" in evals else None,
        "pass_at_k_k": cfg.run.eval_pass_k,
        "steps": loop.step,
        "wall_s": round(time.time() - t_start, 1),
        "max_staleness_seen": loop.max_staleness_seen,
        "interrupted_requests": int(stopped.metrics.get("rollout/interrupted_requests", 0)),
        "straddled_segments": int(stopped.metrics.get("rollout/straddled_segments", 0)),
        "trained_tokens": loop.trained_tokens,
        "expired_groups": loop.expired_groups,
        "max_staleness": cfg.algo.max_staleness,
        "resumed": resumed,
        "final_checkpoint": str(run_dir / "final_hf"),
        "by_length": by_length(inbox.all_evals),
        "by_source": by_source(inbox.all_evals, run_dir),
        # the code sandbox mode in force (reward/isolation_<mode> = 1, see docs/sandbox.md)
        "reward_sandbox": _sandbox_mode(stopped.metrics),
        **_tool_calls(cfg, run_dir),
    }


def _tool_calls(cfg: JobConfig, run_dir: Path, batches: int = 5) -> dict[str, float]:
    """Tool workflows: mean tool calls per episode over the first and the last `batches` trained
    batches (trainer metric episode/tool_calls); nothing for single_turn."""
    if cfg.rollout.workflow.name == "single_turn" or not (run_dir / "metrics.jsonl").exists():
        return {}
    calls = [
        r["episode/tool_calls"] for r in read_jsonl(run_dir / "metrics.jsonl") if "episode/tool_calls" in r
    ]
    if not calls:
        return {}
    return {
        "tool_calls_start": sum(calls[:batches]) / len(calls[:batches]),
        "tool_calls_end": sum(calls[-batches:]) / len(calls[-batches:]),
    }


def _sandbox_mode(metrics: dict[str, float]) -> str | None:
    """The code sandbox mode in force: the reward service sets reward/isolation_<mode> = 1."""
    prefix = "reward/isolation_"
    return next((key.removeprefix(prefix) for key in metrics if key.startswith(prefix)), None)


def _eval_row(ev: m.EvalResult) -> dict:
    """Every field, so that a resumed run's summary has the start evaluation's pass@k too."""
    return dataclasses.asdict(ev)


_LENGTH_COLUMNS = {"start": "sampled_start", "final": "sampled_end",
                   "start_greedy": "greedy_start", "final_greedy": "greedy_end"}  # fmt: skip


def _start_end_table(evals: list[m.EvalResult], split) -> dict[str, dict]:
    """Per key of `split(ev)` = (accuracy by key, prompt count by key): the prompt count and the
    sampled and greedy accuracy of the start and final evaluations (_LENGTH_COLUMNS)."""
    table: dict[str, dict] = {}
    for ev in evals:
        column = _LENGTH_COLUMNS.get(ev.kind)
        if column is None:
            continue
        accuracies, sizes = split(ev)
        for key, accuracy in accuracies.items():
            table.setdefault(key, {"num_prompts": sizes.get(key, 0)})[column] = accuracy
    return table


def by_source(evals: list[m.EvalResult], run_dir: Path, batches: int = 5) -> dict[str, dict]:
    """summary.json's `by_source`: per source (mixtures), the held-out prompt count, the sampled
    and greedy accuracy at the start and the end, and the mean training reward and accuracy over
    the last `batches` batches that had the source; {} without sources."""
    table = _start_end_table(evals, lambda ev: (ev.by_source, ev.source_sizes))
    rows = read_jsonl(run_dir / "metrics.jsonl") if table and (run_dir / "metrics.jsonl").exists() else []
    for name, row in table.items():
        for metric in ("reward", "accuracy"):
            seen = [r[f"source/{name}/{metric}"] for r in rows if f"source/{name}/{metric}" in r][-batches:]
            row[f"train_{metric}"] = sum(seen) / len(seen) if seen else None
    return table


def by_length(evals: list[m.EvalResult]) -> dict[str, dict]:
    """summary.json's `by_length`: per prompt bucket (chain length), the prompt count and the
    sampled and greedy accuracy at the start and the end of the run; {} without buckets."""
    table = _start_end_table(evals, lambda ev: (ev.by_bucket, ev.bucket_sizes))

    def order(bucket: str):  # "1" < "2" < "3-4" < "9-20"; other names after, alphabetically
        head = bucket.split("-")[0]
        return (0, int(head), bucket) if head.isdigit() else (1, 0, bucket)

    return {bucket: table[bucket] for bucket in sorted(table, key=order)}
