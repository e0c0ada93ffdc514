"""Code rewards per second by sandbox mode, in the same run: `netns` (root) vs `userns` (the
unprivileged strong mode, run as nobody as on a cluster) vs `none` (weak, for reference).

Each mode scores the same HumanEval requests (canonical solutions and empty bodies: every one a
sandboxed program) on a 2-worker RewardService; every verdict is checked
(`sandbox/<mode>_wrong_verdicts`). As root, `userns` and the unprivileged `none` run in a child
process as nobody (tests/integration/reward/unprivileged.py); as non-root, `netns` is skipped.
Run: `python -m bench.reward.sandbox_bench [--quick]`. Not part of CI.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from areal_jobs.config import NetworkIsolation, RewardConfig
from areal_jobs.reward.service import RewardService
from bench.reward.reward_bench import NUM_WORKERS, _throughput, code_requests

REPO = Path(__file__).resolve().parents[2]


async def _rate(mode: NetworkIsolation, quick: bool) -> dict[str, float]:
    service = RewardService(RewardConfig(num_workers=NUM_WORKERS, network_isolation=mode))
    service.start()
    try:
        cases = code_requests(quick)
        await service.score_group([cases[0][0]] * NUM_WORKERS)  # warm-up: first sandbox run per worker
        per_s, wrong = await _throughput(service, cases)
        errors = service.metrics()["reward/sandbox_errors"]
    finally:
        service.close()
    return {
        f"sandbox/{mode.value}_code_per_s": per_s,
        f"sandbox/{mode.value}_wrong_verdicts": float(wrong),
        f"sandbox/{mode.value}_sandbox_errors": errors,
    }


def _unprivileged(modes: list[str], quick: bool) -> dict[str, float]:
    sys.path.insert(0, str(REPO / "tests" / "integration" / "reward"))
    from unprivileged import SANDBOX_BENCH_UID, run_unprivileged

    argv = [sys.executable, "-m", "bench.reward.sandbox_bench", "--child", ",".join(modes)] + (
        ["--quick"] if quick else []
    )
    proc = run_unprivileged(argv, timeout_s=1200, uid=SANDBOX_BENCH_UID)
    if proc.returncode != 0:
        raise RuntimeError(f"unprivileged bench failed: {proc.stderr.decode(errors='replace')[-2000:]}")
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


def run(quick: bool = False) -> dict[str, float]:
    metrics: dict[str, float] = {"sandbox/bench_workers": float(NUM_WORKERS)}
    if os.geteuid() == 0:
        metrics.update(asyncio.run(_rate(NetworkIsolation.netns, quick)))
        metrics.update(_unprivileged(["userns", "none"], quick))
    else:
        for mode in (NetworkIsolation.userns, NetworkIsolation.none):
            metrics.update(asyncio.run(_rate(mode, quick)))
    return metrics


def _child(modes: str, quick: bool) -> None:
    out: dict[str, float] = {"sandbox/child_uid": float(os.getuid())}
    for mode in modes.split(","):
        out.update(asyncio.run(_rate(NetworkIsolation(mode), quick)))
    print(json.dumps(out))


if __name__ == "__main__":
    quick = "--quick" in sys.argv[1:]
    if "--child" in sys.argv:
        _child(sys.argv[sys.argv.index("--child") + 1], quick)
    else:
        for name, value in run(quick).items():
            print(f"{name} {value:.2f}")
