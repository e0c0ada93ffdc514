"""The runs the end-to-end bench compares (bench/e2e/e2e_bench.py), each returning per-step metric rows.

- `launch_local`: one `python -m launch.local` run, as `make run` starts it: one SGLang server
  (1 thread), the controller with its reward workers, the torch trainer (1 thread), each its own
  process. The rows are the trainer's metrics.jsonl.
- `colocated_rows`: one SGLang server with every core and, in this process, the real controller
  (eta = 0: one batch per version, then idle), TorchBackend with every core, and the real
  weight-update handshake. Generation and training alternate; neither overlaps.
- `step_breakdown`: where a run's steps went (generation wait, train, publish split into pause,
  broadcast and load + resume, and the tokens re-prefilled after abort-mode interruptions).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from areal_jobs.config import AlgoConfig, DType, RewardConfig, RolloutConfig, TrainerConfig
from areal_jobs.rollout.server import ServerProcess

REPO = Path(__file__).resolve().parents[2]
WARMUP_STEPS = 2  # the first steps pay for compilation, cache warm-up and the first weight update
MAX_NEW_TOKENS = 256  # the full bench's; shape["max_new_tokens"] is each run's


def launch_local(
    run_root: Path, name: str, model_dir: Path, shape: dict, eta: int, *extra: str
) -> list[dict]:
    """One `python -m launch.local` run; returns its per-step metric rows."""
    cmd = [
        sys.executable, "-m", "launch.local",
        f"run.name={name}", f"run.root={run_root}", f"model.path={model_dir}",
        f"algo.max_staleness={eta}", f"algo.batch_size={shape['batch_size']}", f"algo.group_size={shape['group_size']}",
        f"rollout.max_new_tokens={shape['max_new_tokens']}", f"trainer.total_steps={shape['steps']}",
        "trainer.threads=1", "rollout.server_threads=1", "data.num_eval_prompts=0", "run.tensorboard=false", *extra,
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500)
    run_dir = run_root / name
    if result.returncode != 0:
        logs = "\n".join(
            f"== {p.name}\n{p.read_text()[-1500:]}" for p in sorted((run_dir / "logs").glob("*.log"))
        )
        raise RuntimeError(
            f"launch.local {name} failed ({result.returncode}):\n{result.stderr[-2000:]}\n{logs}"
        )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step_s" in r]


def measured(rows: list[dict], name: str) -> list[dict]:
    out = rows[WARMUP_STEPS:]
    if not out:
        raise RuntimeError(f"{name}: no step after the {WARMUP_STEPS} warm-up steps")
    return out


def step_breakdown(rows: list[dict]) -> dict[str, float]:
    """Mean seconds per measured step of each phase, and the throughput over those steps.

    publish = pause (PauseRequest -> Paused: abort or freeze the requests in flight) + broadcast
    (the trainer's buckets) + load_resume (the servers finish loading, flush, resume). Re-prefill
    is not part of publish: it is paid by the servers after the resume, inside the next generation
    wait; `reprefill_tokens` counts it (prompt + partial output of every re-sent segment)."""
    n = len(rows)
    wall = sum(r["time/step_s"] for r in rows)

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in rows) / n

    pause, broadcast, total = (
        mean("weight_sync/pause_s"),
        mean("weight_sync/broadcast_s"),
        mean("weight_sync/total_s"),
    )
    # controller counters arrive every 2 s with the rollout stats: the difference over the window
    first, last = rows[0].get("rollout/reprefill_tokens"), rows[-1].get("rollout/reprefill_tokens")
    reprefill = (last - first) / max(n - 1, 1) if first is not None and last is not None else 0.0
    return {
        "tokens_per_s": sum(r["train/num_tokens"] for r in rows) / wall,
        "step_s": wall / n,
        "gen_wait_s": mean("time/wait_batch_s"),
        "train_s": mean("time/step_train_s"),
        "publish_s": mean("time/publish_s"),
        "pause_s": pause,
        "broadcast_s": broadcast,
        "load_resume_s": max(total - pause - broadcast, 0.0),
        "reprefill_tokens": reprefill,
        "tokens_per_step": sum(r["train/num_tokens"] for r in rows) / n,
        "steps": float(n),
        **(
            {"prefill_tokens_per_s": rows[0]["bench/prefill_tokens_per_s"]}
            if "bench/prefill_tokens_per_s" in rows[0]
            else {}
        ),
    }


async def prefill_tokens_per_s(client, groups) -> float:
    """How fast the server prefills what abort mode re-sends: prompt + output of up to 16 of the
    last batch's samples, each in its own cache namespace (nothing reused), one token generated."""
    from areal_jobs.api import GenerateRequest

    inputs = [list(g.prompt_ids) + list(s.output_ids) for g in groups for s in g.samples][:16]
    salt = secrets.token_hex(4)
    t0 = time.monotonic()
    await asyncio.gather(*(
        client.generate(GenerateRequest(f"prefill-{salt}-{i}", [int(t) for t in ids], 1, cache_salt=f"{salt}-{i}"))
        for i, ids in enumerate(inputs)
    ))  # fmt: skip
    return sum(len(ids) for ids in inputs) / (time.monotonic() - t0)


async def colocated_rows(
    model_dir: Path, shape: dict, log_dir: Path, server: ServerProcess | None = None
) -> tuple[list[dict], float]:
    """Generate-then-train with every core for each phase, through the project's own components;
    then the server's prefill rate (tokens/s, every core) on the last batch's samples.
    `server`: a healthy, idle SGLang server of the bench model with every core's threads (the one
    this would start), used and left running; else one started and stopped here."""
    import torch

    from areal_jobs.reward.service import RewardService
    from areal_jobs.trainer.intake.batch import assemble, split_fresh
    from areal_jobs.trainer.torch.backend import TorchBackend
    from bench.harness import RolloutRig, sglang_server

    threads = os.cpu_count() or 2
    algo = AlgoConfig(max_staleness=0, batch_size=shape["batch_size"], group_size=shape["group_size"])
    rollout = RolloutConfig(max_new_tokens=shape["max_new_tokens"], server_threads=threads)
    torch.set_num_threads(threads)
    backend = TorchBackend(TrainerConfig(threads=threads), algo, str(model_dir), DType.float32)
    backend.setup()
    scorer = RewardService(RewardConfig())
    scorer.start()
    rows = []
    loop = asyncio.get_running_loop()
    try:
        given = contextlib.nullcontext(server) if server is not None else None
        with given or sglang_server(model_dir, threads, log_dir) as server:
            rig = RolloutRig(server, model_dir, rollout, algo, scorer)
            rig.start()
            try:
                t_start = time.monotonic()
                for version in range(shape["steps"]):
                    if time.monotonic() - t_start > shape["cap_s"] and len(rows) > WARMUP_STEPS:
                        break  # reported as e2e/colocated_steps
                    t0 = time.monotonic()
                    groups = await rig.take(algo.batch_size)
                    fresh, expired = split_fresh(groups, version, algo.max_staleness)
                    assert not expired, "eta = 0 admits one batch per version"
                    t1 = time.monotonic()
                    batch = assemble(fresh, version, algo)
                    await loop.run_in_executor(None, backend.train_step, batch)
                    t2 = time.monotonic()
                    await rig.publish(version + 1, dict(backend.iter_weights()), tuple(batch.group_ids))
                    t3 = time.monotonic()
                    rows.append({
                        "train/num_tokens": float(batch.num_output_tokens), "time/step_s": t3 - t0,
                        "time/wait_batch_s": t1 - t0, "time/step_train_s": t2 - t1, "time/publish_s": t3 - t2,
                    })  # fmt: skip
                await rig.cut()  # the next batch's requests: stopped, so the probe has the server alone
                prefill = await prefill_tokens_per_s(rig.client, fresh)
            finally:
                await rig.close()
    finally:
        scorer.close()
    return rows, prefill
