"""Generation throughput under weight updates, for the three pause modes, on one real SGLang server.

The real controller generates the built-in task with the bench model (max_concurrent 64: the
server's batch stays full) while a stand-in trainer publishes the same weights as version v+1
every `interval_s` through the real handshake. The staleness bound is lifted (eta = 10^4) so that
only the pause mode differs between runs:
  abort     in-flight requests return their partial answers and are re-sent (KV recomputed)
  in_place  requests stay in the server, keeping their (old-weight) KV cache
  drain     admission stops and the update waits until every in-flight request has finished
Tokens/s counts every token generated between the first and the last update (partial answers
included; a request that spans the window's edge is counted pro rata, see harness.TimedClient). Modes alternate over `rounds` so a change in machine load hits all of them alike.

The handshake flushes SGLang's cache after every update, which SGLang refuses while a request is
in its running batch: always so under in_place. The bench skips that flush under in_place and
retries it otherwise, and reports how often (`*_flush_skipped`, `*_flush_retries`): see the
runtime issue in bench/README.md.

Run: `python -m bench.rollout.pause_bench [--quick]`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from areal_jobs.config import AlgoConfig, PauseMode, RolloutConfig
from bench.harness import InstantScorer, RolloutRig, model_weights, run_on_server

MAX_CONCURRENT = 64
MAX_NEW_TOKENS = 256
# quick (the CI smoke): shorter answers. drain's update waits for the longest request in flight,
# so its publishes take (answer length / decode speed): 49 s each at 256 tokens on a loaded 2-core
# machine, which made this smoke section 99 s of the suite
QUICK_MAX_NEW_TOKENS = 64


async def measure_mode(
    server,
    model_dir: Path,
    mode: PauseMode,
    duration_s: float,
    interval_s: float,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> dict:
    rollout = RolloutConfig(max_new_tokens=max_new_tokens, max_concurrent=MAX_CONCURRENT, pause_mode=mode)
    algo = AlgoConfig(max_staleness=10_000, batch_size=8, group_size=8)
    rig = RolloutRig(server, model_dir, rollout, algo, InstantScorer())
    weights = model_weights(model_dir)

    async def consume() -> None:  # the trainer side: take every group as it arrives
        while True:
            await rig.groups.get()

    rig.start()
    consumer = asyncio.create_task(consume())
    try:
        await asyncio.sleep(interval_s)  # warm-up: the server's batch fills
        await rig.publish(1, weights)
        t0 = time.monotonic()
        interrupted0 = rig.ctl.counters.interrupted_requests
        version = 1
        while time.monotonic() - t0 < duration_s:
            await asyncio.sleep(interval_s)
            rig.check()
            version += 1
            await rig.publish(version, weights)
        interrupted = rig.ctl.counters.interrupted_requests - interrupted0
        t_end = await rig.cut()
        return {
            "tokens": rig.timed.tokens_between(t0, t_end),
            "elapsed_s": t_end - t0,
            "updates": version - 1,
            "update_s": sum(rig.update_s[1:]) / max(1, len(rig.update_s) - 1),
            "interrupted": interrupted,
            "flush_retries": rig.timed.flush_retries,
            "flush_skipped": rig.timed.flush_skipped,
        }
    finally:
        consumer.cancel()
        await rig.close()


async def _run(server, model_dir: Path, quick: bool) -> dict[str, float]:
    duration_s, interval_s, rounds = (8.0, 2.0, 1) if quick else (21.0, 3.0, 1)
    max_new_tokens = QUICK_MAX_NEW_TOKENS if quick else MAX_NEW_TOKENS
    totals: dict[PauseMode, dict[str, float]] = {}
    for _ in range(rounds):
        for mode in (PauseMode.abort, PauseMode.in_place, PauseMode.drain):
            got = await measure_mode(server, model_dir, mode, duration_s, interval_s, max_new_tokens)
            acc = totals.setdefault(mode, dict.fromkeys(got, 0.0))
            for key in ("tokens", "elapsed_s", "interrupted", "flush_retries", "flush_skipped"):
                acc[key] += got[key]
            acc["update_s"] += got["update_s"] / rounds
    out: dict[str, float] = {
        "pause/update_interval_s": interval_s,
        "pause/max_new_tokens": float(max_new_tokens),
    }
    for mode, acc in totals.items():
        out[f"pause/{mode.value}_gen_tokens_per_s"] = acc["tokens"] / acc["elapsed_s"]
        out[f"pause/{mode.value}_update_s"] = acc["update_s"]
        out[f"pause/{mode.value}_interrupted_requests"] = acc["interrupted"]
        out[f"pause/{mode.value}_flush_retries"] = acc["flush_retries"]
        out[f"pause/{mode.value}_flush_skipped"] = acc["flush_skipped"]
    best = out["pause/in_place_gen_tokens_per_s"]
    for mode in ("abort", "drain"):
        out[f"pause/{mode}_over_in_place"] = out[f"pause/{mode}_gen_tokens_per_s"] / best
    return out


def run(quick: bool = False, server=None) -> dict[str, float]:
    """Generated tokens/s under periodic weight updates for abort, in_place and drain."""
    return run_on_server(_run, quick, server, prefix="pause_bench_")


if __name__ == "__main__":
    for name, value in run(quick="--quick" in sys.argv[1:]).items():
        print(f"{name} {value:.4g}")
