"""Rewards on against rewards off: the controller's generation throughput when every finished
group is scored by the real RewardService (2 worker processes, the built-in `arith` verifier),
against a scorer that returns at once. Same controller, same SGLang server, same prompts.

A group holds its admission slot until it is scored, so a slow or blocking scorer shows up as
fewer requests in the server's batch and fewer tokens/s. Runs alternate off/on over `rounds`
so that a change in machine load hits both alike. Rewards must cost no more than a few percent.

Run: `python -m bench.reward.reward_overhead_bench [--quick]`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from areal_jobs.api import RewardRequest
from areal_jobs.config import AlgoConfig, RewardConfig, RolloutConfig
from bench.harness import InstantScorer, RolloutRig, run_on_server

MAX_CONCURRENT = 64


async def generate_for(server, model_dir: Path, scorer, duration_s: float) -> tuple[float, float, int]:
    """(generated tokens, seconds, groups) with the staleness bound lifted and no weight updates."""
    rollout = RolloutConfig(max_new_tokens=256, max_concurrent=MAX_CONCURRENT)
    algo = AlgoConfig(max_staleness=10_000, batch_size=8, group_size=8)
    rig = RolloutRig(server, model_dir, rollout, algo, scorer)
    rig.start()
    try:
        await asyncio.sleep(2.0)  # warm-up: the server's batch fills
        rig.check()
        t0, groups0 = time.monotonic(), rig.ctl.counters.groups_pushed
        await asyncio.sleep(duration_s)
        rig.check()
        groups = rig.ctl.counters.groups_pushed - groups0
        t_end = await rig.cut()
        return rig.timed.tokens_between(t0, t_end), t_end - t0, groups
    finally:
        await rig.close()


async def _run(server, model_dir: Path, quick: bool) -> dict[str, float]:
    from areal_jobs.reward.service import RewardService

    duration_s, rounds = (6.0, 1) if quick else (12.0, 2)
    service = RewardService(RewardConfig())
    service.start()
    totals = {"off": [0.0, 0.0, 0], "on": [0.0, 0.0, 0]}
    try:
        # workers import their verifiers on start: wait for that before the first timed run
        await service.score_group(
            [RewardRequest("arith", "The answer is 3.", "3")] * RewardConfig().num_workers
        )
        for _ in range(rounds):
            for kind, scorer in (("off", InstantScorer()), ("on", service)):
                tokens, seconds, groups = await generate_for(server, model_dir, scorer, duration_s)
                acc = totals[kind]
                acc[0] += tokens
                acc[1] += seconds
                acc[2] += groups
        calls = service.metrics()
    finally:
        service.close()
    off = totals["off"][0] / totals["off"][1]
    on = totals["on"][0] / totals["on"][1]
    return {
        "reward_overhead/off_gen_tokens_per_s": off,
        "reward_overhead/on_gen_tokens_per_s": on,
        "reward_overhead/on_over_off": on / off,
        "reward_overhead/scored_groups": float(totals["on"][2]),
        "reward_overhead/mean_reward_latency_s": calls["reward/mean_latency_s"],
        "reward_overhead/non_ok_rewards": calls["reward/timeouts"] + calls["reward/sandbox_errors"],
    }


def run(quick: bool = False, server=None) -> dict[str, float]:
    """Generation tokens/s with the real reward service against an instant scorer."""
    return run_on_server(_run, quick, server, prefix="reward_overhead_")


if __name__ == "__main__":
    for name, value in run(quick="--quick" in sys.argv[1:]).items():
        print(f"{name} {value:.4g}")
