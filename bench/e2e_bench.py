"""End to end on the built-in task: effective training throughput (trained tokens/s) of
asynchronous RL (eta = 4) against synchronous RL (eta = 0) with the same processes, and against
colocated synchronous RL (generate with every core, then train with every core).

- async / sync: `python -m launch.local` twice, identical but for algo.max_staleness: one SGLang
  server (1 thread), the controller with its reward workers, the torch trainer (1 thread), each
  its own process, as `make run` starts them.
- colocated: one SGLang server with 2 threads and, in this process, the real controller
  (eta = 0, so it generates exactly one batch per version, then idles), TorchBackend with 2 threads,
  and the real weight-update handshake. Generation and training alternate; neither overlaps.
All three use the bench model (the built-in tiny Qwen2, warm-started so answer lengths follow the
task's long tail), the same batch (B groups x G answers), max_new_tokens, trainer settings and
number of steps, and count tokens the same way: output tokens trained per step over the step's
wall time (wait for batch + train + publish), summed over the steps after `WARMUP_STEPS`.

The ideal overlap bound comes from the synchronous run's measured phases:
T_gen = mean wait-for-batch, T_train = mean (train + publish); bound = (T_gen + T_train) / max(...).

Run: `python -m bench.e2e_bench [--quick]`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from areal_jobs.config import AlgoConfig, DType, RewardConfig, RolloutConfig, TrainerConfig

REPO = Path(__file__).resolve().parents[1]
RUN_ROOT = REPO / "runs" / "bench" / "e2e"  # run directories (metrics, logs) of the last bench
WARMUP_STEPS = 2
BATCH_SIZE = 8
GROUP_SIZE = 8
MAX_NEW_TOKENS = 256


def _shape(quick: bool) -> dict:
    # cap_s bounds the colocated run: a 2-thread server on a 2-core machine that someone else is
    # also using slows down many-fold (each OpenMP region waits for the descheduled thread)
    return {
        "steps": 5 if quick else 12,
        "batch_size": 4 if quick else BATCH_SIZE,
        "group_size": GROUP_SIZE,
        "cap_s": 150.0 if quick else 300.0,
    }


def launch_local(
    run_root: Path, name: str, model_dir: Path, shape: dict, eta: int, *extra: str
) -> list[dict]:
    """One `python -m launch.local` run; returns its per-step metric rows."""
    cmd = [
        sys.executable, "-m", "launch.local",
        f"run.name={name}", f"run.root={run_root}", f"model.path={model_dir}",
        f"algo.max_staleness={eta}", f"algo.batch_size={shape['batch_size']}", f"algo.group_size={shape['group_size']}",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}", f"trainer.total_steps={shape['steps']}",
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


def summarize(rows: list[dict], prefix: str) -> dict[str, float]:
    """Throughput and mean phase times over the steps after the warm-up."""
    measured = rows[WARMUP_STEPS:]
    if not measured:
        raise RuntimeError(f"{prefix}: no step after the {WARMUP_STEPS} warm-up steps")
    tokens = sum(r["train/num_tokens"] for r in measured)
    wall = sum(r["time/step_s"] for r in measured)
    n = len(measured)
    return {
        f"e2e/{prefix}_tokens_per_s": tokens / wall,
        f"e2e/{prefix}_step_s": wall / n,
        f"e2e/{prefix}_gen_wait_s": sum(r["time/wait_batch_s"] for r in measured) / n,
        f"e2e/{prefix}_train_s": sum(r["time/step_train_s"] for r in measured) / n,
        f"e2e/{prefix}_publish_s": sum(r["time/publish_s"] for r in measured) / n,
        f"e2e/{prefix}_tokens_per_step": tokens / n,
        f"e2e/{prefix}_steps": float(n),
    }


async def colocated_rows(model_dir: Path, shape: dict, log_dir: Path) -> list[dict]:
    """Generate-then-train with every core for each phase, through the project's own components."""
    import torch

    from areal_jobs.reward.service import RewardService
    from areal_jobs.trainer.batch import assemble, split_fresh
    from areal_jobs.trainer.torch_backend import TorchBackend
    from bench.harness import RolloutRig, sglang_server

    threads = os.cpu_count() or 2
    algo = AlgoConfig(max_staleness=0, batch_size=shape["batch_size"], group_size=shape["group_size"])
    rollout = RolloutConfig(max_new_tokens=MAX_NEW_TOKENS, server_threads=threads)
    torch.set_num_threads(threads)
    backend = TorchBackend(TrainerConfig(threads=threads), algo, str(model_dir), DType.float32)
    backend.setup()
    scorer = RewardService(RewardConfig())
    scorer.start()
    rows = []
    loop = asyncio.get_running_loop()
    try:
        with sglang_server(model_dir, threads, log_dir) as server:
            rig = RolloutRig(server, model_dir, rollout, algo, scorer)
            rig.start()
            try:
                t_start = time.monotonic()
                for version in range(shape["steps"]):
                    if time.monotonic() - t_start > shape["cap_s"] and len(rows) >= WARMUP_STEPS + 2:
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
            finally:
                await rig.close()
    finally:
        scorer.close()
    return rows


def ideal_bound(sync: dict[str, float]) -> tuple[float, float, float]:
    t_gen = sync["e2e/sync_gen_wait_s"]
    t_train = sync["e2e/sync_train_s"] + sync["e2e/sync_publish_s"]
    return t_gen, t_train, (t_gen + t_train) / max(t_gen, t_train)


def run(quick: bool = False) -> dict[str, float]:
    """Async vs sync (same processes) vs colocated sync, and the ideal overlap bound."""
    from bench.harness import bench_model

    model_dir = bench_model()
    shape = _shape(quick)
    out: dict[str, float] = {}
    root = RUN_ROOT / ("quick" if quick else "full")
    shutil.rmtree(root, ignore_errors=True)  # the previous bench's runs: logs are kept until the next one
    root.mkdir(parents=True)
    out.update(summarize(launch_local(root, "sync", model_dir, shape, eta=0), "sync"))
    out.update(summarize(launch_local(root, "async", model_dir, shape, eta=4), "async"))
    out.update(summarize(asyncio.run(colocated_rows(model_dir, shape, root)), "colocated"))
    if not quick:  # the same async run with rollout.pause_mode=in_place: no prefix recomputation
        in_place = launch_local(root, "async_in_place", model_dir, shape, 4, "rollout.pause_mode=in_place")
        out.update(summarize(in_place, "async_in_place"))
    t_gen, t_train, bound = ideal_bound(out)
    ratio = out["e2e/async_tokens_per_s"] / out["e2e/sync_tokens_per_s"]
    out.update({
        "e2e/async_over_sync": ratio,
        "e2e/async_over_colocated": out["e2e/async_tokens_per_s"] / out["e2e/colocated_tokens_per_s"],
        "e2e/ideal_T_gen_s": t_gen, "e2e/ideal_T_train_s": t_train,
        "e2e/ideal_overlap_bound": bound,
        "e2e/async_over_sync_share_of_bound": ratio / bound,
    })  # fmt: skip
    if "e2e/async_in_place_tokens_per_s" in out:
        in_place_ratio = out["e2e/async_in_place_tokens_per_s"] / out["e2e/sync_tokens_per_s"]
        out["e2e/async_in_place_over_sync"] = in_place_ratio
        out["e2e/async_in_place_over_sync_share_of_bound"] = in_place_ratio / bound
    return out


if __name__ == "__main__":
    for name, value in run(quick="--quick" in sys.argv[1:]).items():
        print(f"{name} {value:.4g}")
