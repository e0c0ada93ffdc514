"""The rollout controller process.

    python -m areal_jobs.rollout.main --config RUN_DIR/config.yaml

Waits for the rollout servers to register, binds the ZeroMQ channels, then runs the controller
until the trainer says Stop. Exits non-zero on any failure so SLURM can requeue the job.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from areal_jobs.agent.context import EpisodeText
from areal_jobs.agent.tools import Toolbox
from areal_jobs.checkpoint import latest_checkpoint
from areal_jobs.config import JobConfig, RewardSource, RoutingReplay, load_job_config
from areal_jobs.data.prompts import describe_first_prompt, load_prompts
from areal_jobs.data.tokenizer import load_tokenizer
from areal_jobs.logs import setup_logging
from areal_jobs.rollout.controller import RolloutController
from areal_jobs.rollout.engines import control_retry
from areal_jobs.rollout.engines import make_client as engine_client
from areal_jobs.rollout.reward_client import build_model_scorer
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.rollout.service import ControllerService
from areal_jobs.rollout.snapshot import load_snapshot
from areal_jobs.rollout.weight_update import WeightUpdateOrchestrator
from areal_jobs.samples import SampleDump
from areal_jobs.transport import discovery
from areal_jobs.transport.channels import ControllerChannel

logger = logging.getLogger("areal_jobs.rollout.main")


async def run(cfg: JobConfig, run_dir: Path, token: str) -> int:
    from areal_jobs.reward.service import RewardService

    # A USR1 (preemption, `scancel --signal=USR1`) can come while the servers are still starting:
    # remembered here, acted on once the service runs, instead of the default action (exit)
    early_preemption: list[int] = []
    signal.signal(signal.SIGUSR1, lambda signum, _: early_preemption.append(signum))
    model_dir = cfg.model.path or cfg.model.builtin_dir
    tokenizer = load_tokenizer(model_dir)
    prompts = load_prompts(cfg.data, model_dir, tokenizer.encode, cfg.reward.function)
    logger.info("%s", describe_first_prompt(prompts))
    if cfg.data.dataset.value == "humaneval":  # a broken reference fails here, not as silent zeros
        from areal_jobs.reward.code import check_humaneval_references

        references = [r.reference for r in prompts.stream.rows or []] + [
            p.reference for p in prompts.held_out
        ]
        check_humaneval_references(references, "the data files")

    retry = control_retry(cfg.rollout.call_timeout_s, cfg.control)

    def make_client(rec: discovery.ServerRecord):
        return engine_client(
            cfg.rollout.engine, f"{rec.index}", rec.url, token,
            generate_timeout_s=cfg.rollout.request_timeout_s, call_timeout_s=cfg.rollout.call_timeout_s,
            retry=retry, load_deadline_s=cfg.control.load_deadline_s,
            tp_size=cfg.rollout.tp_size,
            routes=cfg.trainer.routing_replay is RoutingReplay.rollout,
        )  # fmt: skip

    # each server's own process gives up sooner when its start makes no progress (server.py)
    start_s = max(cfg.rollout.server_start_timeout_s, cfg.control.server_start_deadline_s)
    records = discovery.wait_for_servers(run_dir, cfg.rollout.num_servers, start_s)
    pool = ServerPool(cfg.rollout.tp_size)
    for rec in records:
        pool.add(rec.index, make_client(rec), cfg.rollout.tp_size)
    verifier = RewardService(cfg.reward)
    verifier.start()
    scorer, eval_scorer, scoring_pool = verifier, None, None
    if cfg.reward.source is not RewardSource.verifier:
        scorer, scoring_pool = build_model_scorer(cfg, run_dir, token, verifier, start_s)
        eval_scorer = verifier  # held-out accuracy stays the checker's
    host = os.environ.get("AREAL_BIND_HOST", "127.0.0.1")
    ports = _controller_ports(cfg, run_dir, host)
    channel = ControllerChannel(host, ports[0], ports[1], token)
    channel.bind()
    discovery.register_controller(run_dir, host, ports[0], ports[1])
    controller = RolloutController(
        cfg.rollout, cfg.algo, pool, scorer, prompts.stream,
        decode=tokenizer.decode, push=channel.push_group, stop_token_ids=tokenizer.stop_token_ids,
        text=EpisodeText(tokenizer.encode, tokenizer.decode, tokenizer.decode_raw, prompts.format.message_texts),
        max_context_tokens=_context_tokens(model_dir),
        call_tool=Toolbox(verifier, cfg.rollout.workflow.tool_timeout_s, cfg.rollout.workflow.tool_output_chars).call,
    )  # fmt: skip
    orchestrator = WeightUpdateOrchestrator(
        pool, cfg.rollout.pause_mode, cfg.weight_sync.step_timeout_s, cfg.control.call_deadline_s
    )
    service = ControllerService(
        controller, pool, orchestrator, channel, prompts.held_out,
        eval_every_steps=cfg.run.eval_every_steps, eval_samples=cfg.run.eval_samples,
        eval_k=cfg.run.eval_pass_k, step_timeout_s=cfg.weight_sync.step_timeout_s,
        health_interval_s=cfg.rollout.health_interval_s, make_client=make_client,
        discover=lambda: discovery.read_servers(run_dir),
        leaving=lambda: discovery.leaving(run_dir),
        on_drained=lambda index: discovery.mark_drained(run_dir, index),
        release_memory_while_training=cfg.rollout.release_memory_while_training,
        update_deadline_s=cfg.control.update_deadline_s, health_grace_s=cfg.control.health_grace_s,
    )  # fmt: skip
    service.eval_scorer = eval_scorer
    if cfg.run.samples_every_steps > 0:
        service.dump_samples = SampleDump(run_dir / "samples.jsonl", cfg.run.samples_print).write
        service.decode_raw = tokenizer.decode_raw
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        # the trainer drives the checkpoint; this process only stays up long enough to serve it
        loop.add_signal_handler(sig, service.preempted.set)
    if early_preemption:
        logger.info("USR1 arrived during start-up: checkpointing as soon as the trainer asks")
        service.preempted.set()
    checkpoint = latest_checkpoint(run_dir) if cfg.checkpoint.resume else None
    restored = load_snapshot(checkpoint / "rollout") if checkpoint is not None else None
    try:
        code = await service.run(restored)
        _write_final_state(run_dir, controller)
        return code
    finally:
        verifier.close()
        if scoring_pool is not None:
            await scoring_pool.close()
        channel.close()
        for slot in pool.slots.values():
            await slot.client.close()


def _write_final_state(run_dir: Path, controller: RolloutController) -> None:
    """Which prompts were still pending at the end: with the ledger, proves none was lost."""
    snap = controller.snapshot(step=-1)
    state = {
        "stream_position": snap.stream_position,
        "in_progress": sorted(g.data_index for g in snap.partial),
        "untrained": sorted(g.data_index for g in snap.retained),
        "requeued": sorted(i for i, _ in snap.requeued),
    }
    (run_dir / "rollout_final.json").write_text(json.dumps(state, indent=2))


def _context_tokens(model_dir: str) -> int:
    """The model's context length (multi-turn episodes stop a turn there); 0 = not stated."""
    config = Path(model_dir) / "config.json"
    if not config.exists():
        return 0
    return int(json.loads(config.read_text()).get("max_position_embeddings") or 0)


def _controller_ports(cfg: JobConfig, run_dir: Path, host: str) -> tuple[int, int]:
    if cfg.rollout.controller_port:
        return cfg.rollout.controller_port, cfg.rollout.controller_port + 1
    traj, ctrl = discovery.free_ports(host, 2)
    return traj, ctrl


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="resolved run config (RUN_DIR/config.yaml)")
    args = parser.parse_args(argv)
    setup_logging("controller")
    cfg = load_job_config(args.config)
    token = os.environ.get("AREAL_JOB_TOKEN") or cfg.run.token
    if not token:
        raise SystemExit("no job token: set AREAL_JOB_TOKEN (the launcher does) or run.token")
    try:
        return asyncio.run(run(cfg, Path(args.config).resolve().parent, token))
    except Exception:
        logger.exception("controller failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
