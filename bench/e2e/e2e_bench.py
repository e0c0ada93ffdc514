"""End to end on the built-in task: effective training throughput (trained tokens/s) of
asynchronous RL (eta = 4), once per pause mode, against synchronous RL (eta = 0) with the same
processes, and against colocated synchronous RL (generate with every core, then train with every
core). The runs themselves are in bench/e2e/e2e_runs.py.

A bench that can decide: the modes run interleaved in rounds (round r starts at mode r, so a
drift in the machine's load hits every mode alike), 3 rounds of 12 steps each (the first 2 are
warm-up: 30 measured steps per mode). Each ratio is computed within a round (async over the same
round's sync) and reported as median, min, max and spread = (max - min) / median over the rounds;
the load average is recorded before and after every run. Quick mode: 1 round of 5 steps, answers of at most 64 tokens (smoke);
under `make bench --quick` on a 2-core machine the colocated run goes first, on the SGLang server
the earlier sections shared (the server it would start), stopped before the launch.local runs.

All runs use the bench model (the built-in tiny Qwen2, warm-started so answer lengths follow the
task's long tail), the same batch (B groups x G answers), max_new_tokens and trainer settings,
and count tokens the same way: output tokens trained per step over the step's wall time (wait for
batch + train + publish), summed over the measured steps.

The ideal overlap bound of a round comes from its synchronous run's measured phases:
T_gen = mean wait-for-batch, T_train = mean (train + publish); bound = (T_gen + T_train) / max(...).
A share of the bound of 100% means generation and training overlap perfectly.

Run: `python -m bench.e2e.e2e_bench [--quick]`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from areal_jobs.config import PauseMode, RolloutConfig
from areal_jobs.rollout.server import ServerProcess
from bench.e2e.e2e_runs import MAX_NEW_TOKENS, colocated_rows, launch_local, measured, step_breakdown

REPO = Path(__file__).resolve().parents[2]
RUN_ROOT = REPO / "runs" / "bench" / "e2e"  # run directories (metrics, logs) of the last bench
BATCH_SIZE = 8
GROUP_SIZE = 8
DEFAULT_MODE = f"async_{RolloutConfig().pause_mode.value}"  # what `make run` does
ASYNC_MODES = tuple(f"async_{p.value}" for p in (PauseMode.abort, PauseMode.in_place))


def _shape(quick: bool) -> dict:
    # cap_s bounds the colocated run (its measured steps are reported; it is the reference, not
    # a mode being decided): a 2-thread server on a 2-core machine that someone else is also
    # using slows down many-fold (each OpenMP region waits for the descheduled thread)
    # quick (the CI smoke) answers in at most 64 tokens: generation is most of a step, and the
    # colocated run's 2-thread server on a 2-core machine shared with the rest of the suite took
    # 15 s per step at 256 (each OpenMP region waits for its descheduled thread)
    return {
        "steps": 5 if quick else 12,
        "rounds": 1 if quick else 3,
        "batch_size": 4 if quick else BATCH_SIZE,
        "group_size": GROUP_SIZE,
        "max_new_tokens": 64 if quick else MAX_NEW_TOKENS,
        "cap_s": 150.0 if quick else 60.0,
    }


def modes(quick: bool) -> list[str]:
    """Quick: the default async mode only; full: every async pause mode."""
    return ["sync", *((DEFAULT_MODE,) if quick else ASYNC_MODES), "colocated"]


def run_mode(
    mode: str, root: Path, model_dir: Path, shape: dict, server: ServerProcess | None = None
) -> list[dict]:
    if mode == "colocated":
        rows, prefill = asyncio.run(colocated_rows(model_dir, shape, root, server))
        for row in rows:
            row["bench/prefill_tokens_per_s"] = prefill
        return rows
    if mode == "sync":
        return launch_local(root, mode, model_dir, shape, 0)
    pause = mode.removeprefix("async_")
    return launch_local(root, mode, model_dir, shape, 4, f"rollout.pause_mode={pause}")


def ideal_bound(sync: dict[str, float]) -> tuple[float, float, float]:
    t_gen = sync["gen_wait_s"]
    t_train = sync["train_s"] + sync["publish_s"]
    return t_gen, t_train, (t_gen + t_train) / max(t_gen, t_train)


def round_ratios(runs: dict[str, dict[str, float]]) -> dict[str, float]:
    """The ratios of one round: each async mode over the same round's sync and colocated runs."""
    _, _, bound = ideal_bound(runs["sync"])
    out = {"ideal_overlap_bound": bound}
    for mode in runs:
        if mode.startswith("async_"):
            over_sync = runs[mode]["tokens_per_s"] / runs["sync"]["tokens_per_s"]
            out[f"{mode}_over_sync"] = over_sync
            out[f"{mode}_share_of_bound"] = over_sync / bound
            out[f"{mode}_over_colocated"] = runs[mode]["tokens_per_s"] / runs["colocated"]["tokens_per_s"]
            # the bound assumes each phase keeps its sync speed while they overlap: > 1 = contention
            out[f"{mode}_train_s_per_token_over_sync"] = (
                runs[mode]["train_s"] / runs[mode]["tokens_per_step"]
            ) / (runs["sync"]["train_s"] / runs["sync"]["tokens_per_step"])
    return out


def spread_stats(name: str, values: list[float]) -> dict[str, float]:
    med = statistics.median(values)
    return {
        f"e2e/{name}_median": med,
        f"e2e/{name}_min": min(values),
        f"e2e/{name}_max": max(values),
        f"e2e/{name}_spread": (max(values) - min(values)) / med if med else 0.0,
    }


def run(
    quick: bool = False, server: ServerProcess | None = None, release: Callable[[], None] | None = None
) -> dict[str, float]:
    """Every mode, interleaved, for shape["rounds"] rounds; medians, spreads and the load.
    `server`, `release`: `make bench --quick` on a machine whose cores equal the threads of the
    SGLang server the sections share hands that server over (the one the colocated run would
    start: the bench model, every core, the same token budget; one SGLang start fewer). The
    colocated run then goes first, on it, and `release()` stops it before the launch.local runs
    start their own processes."""
    from bench.harness import bench_model

    model_dir = bench_model()
    shape = _shape(quick)
    names = modes(quick)
    root = RUN_ROOT / ("quick" if quick else "full")
    shutil.rmtree(root, ignore_errors=True)  # the previous bench's runs: logs are kept until the next one
    per_round: list[dict[str, dict[str, float]]] = []
    loads: dict[str, list[float]] = {name: [] for name in names}
    for r in range(shape["rounds"]):
        order = names[r % len(names) :] + names[: r % len(names)]
        if server is not None:  # its server first, then freed for the launch.local runs
            order = ["colocated", *(mode for mode in order if mode != "colocated")]
        runs: dict[str, dict[str, float]] = {}
        for mode in order:
            round_root = root / f"round{r}"
            round_root.mkdir(parents=True, exist_ok=True)
            load_before = os.getloadavg()[0]
            t0 = time.monotonic()
            shared = server if mode == "colocated" else None
            runs[mode] = step_breakdown(measured(run_mode(mode, round_root, model_dir, shape, shared), mode))
            if shared is not None:
                server = None
                if release is not None:
                    release()
            runs[mode]["wall_s"] = time.monotonic() - t0
            loads[mode] += [load_before, os.getloadavg()[0]]
            (round_root / f"{mode}.json").write_text(json.dumps(runs[mode], indent=1))  # post-mortems
            print(f"[bench] e2e round {r} {mode}: {runs[mode]['tokens_per_s']:.0f} tokens/s, "
                  f"load {load_before:.1f} -> {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)  # fmt: skip
        per_round.append(runs)
    return summarize(per_round, loads, shape)


def summarize(per_round: list[dict], loads: dict[str, list[float]], shape: dict) -> dict[str, float]:
    """Flat metrics: per mode the median over rounds of each breakdown figure and the number of
    measured steps; per ratio median/min/max/spread; the default mode under the headline keys."""
    out: dict[str, float] = {
        "e2e/rounds": float(len(per_round)),
        "e2e/steps_per_run": float(shape["steps"]),
        "e2e/max_new_tokens": float(shape["max_new_tokens"]),
    }
    for mode in per_round[0]:
        for key in per_round[0][mode]:
            values = [runs[mode][key] for runs in per_round]
            out[f"e2e/{mode}_{key}"] = sum(values) if key == "steps" else statistics.median(values)
        out[f"e2e/{mode}_load_mean"] = statistics.fmean(loads[mode])
        out[f"e2e/{mode}_load_max"] = max(loads[mode])
    rate = out.get("e2e/colocated_prefill_tokens_per_s")
    for mode in per_round[0]:
        if rate and mode != "colocated":  # seconds of server time, at the colocated server's threads
            out[f"e2e/{mode}_reprefill_s_est"] = out[f"e2e/{mode}_reprefill_tokens"] / rate
    ratios = [round_ratios(runs) for runs in per_round]
    for key in ratios[0]:
        out.update(spread_stats(key, [r[key] for r in ratios]))
    every_load = [x for values in loads.values() for x in values]
    out["e2e/load_mean"] = statistics.fmean(every_load)
    out["e2e/load_max"] = max(every_load)
    # headline keys (stable across benches): the default configuration, as `make run` runs it
    t_gen, t_train, _ = ideal_bound({k: out[f"e2e/sync_{k}"] for k in ("gen_wait_s", "train_s", "publish_s")})
    out.update({
        "e2e/async_tokens_per_s": out[f"e2e/{DEFAULT_MODE}_tokens_per_s"],
        "e2e/async_over_sync": out[f"e2e/{DEFAULT_MODE}_over_sync_median"],
        "e2e/async_over_sync_share_of_bound": out[f"e2e/{DEFAULT_MODE}_share_of_bound_median"],
        "e2e/async_over_colocated": out[f"e2e/{DEFAULT_MODE}_over_colocated_median"],
        "e2e/ideal_overlap_bound": out["e2e/ideal_overlap_bound_median"],
        "e2e/ideal_T_gen_s": t_gen, "e2e/ideal_T_train_s": t_train,
        "e2e/default_is_in_place": float(DEFAULT_MODE == "async_in_place"),
    })  # fmt: skip
    return out


if __name__ == "__main__":
    for name, value in run(quick="--quick" in sys.argv[1:]).items():
        print(f"{name} {value:.4g}")
