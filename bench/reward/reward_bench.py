"""Reward throughput on a 2-worker pool (the CI machine has 2 cores): rewards scored per second.

Math: GSM8K gold solutions and the same solutions with the final number changed (the numeric fast
path), and LaTeX answers that need the symbolic verifier. Code: HumanEval canonical solutions and
empty bodies, each one a sandboxed program. Every verdict is checked; a wrong one is reported as
`reward/bench_wrong_verdicts`, so a fast but broken verifier cannot look good.

Data comes from ../shared/data when present, else from the fixtures in tests/fixtures.
Run: `python -m bench.reward.reward_bench [--quick]`.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from pathlib import Path

from areal_jobs.api import RewardRequest
from areal_jobs.config import RewardConfig
from areal_jobs.reward.service import RewardService

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO / ".." / "shared" / "data"
FIXTURES = REPO / "tests" / "fixtures"
NUM_WORKERS = 2
GROUP_SIZE = 8  # G answers per prompt, scored as one score_group call, as the controller does


def _symbolic_cases(k: int) -> list[tuple[str, str, bool]]:
    """(LaTeX answer, gold, equivalent?) that only the symbolic verifier can decide. Distinct for
    every k, so math-verify's parse caches cannot make repeats look cheap."""
    return [
        (f"{k}\\sqrt{{2}}", f"\\sqrt{{{2 * k * k}}}", True),
        (f"(x+{k})^2", f"x^2+{2 * k}x+{k * k}", True),
        (f"\\frac{{\\sqrt{{3}}}}{{{k}}}", f"\\frac{{1}}{{{k}}}\\sqrt{{3}}", True),
        (f"\\{{{k},{k + 1}\\}}", f"\\{{{k + 1},{k}\\}}", True),
        (f"[{k}, {k + 1})", f"[{k},{k + 1}]", False),
        (f"{k}\\pi", f"{k + 1}\\pi", False),
    ]


def _rows(name: str, shared: str, fixture: str, quick_rows: int, quick: bool) -> list[dict]:
    path = SHARED / name / shared if (SHARED / name / shared).exists() else FIXTURES / name / fixture
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return rows[:quick_rows] if quick else rows


def math_requests(quick: bool) -> list[tuple[RewardRequest, float]]:
    out = []
    for row in _rows("gsm8k", "test.jsonl", "test_head50.jsonl", 100, quick):
        solution, gold = row["answer"], row["answer"].split("####")[-1].strip()
        out.append((RewardRequest("gsm8k", solution, gold), 1.0))
        number = re.search(r"[\d,]*\d\s*$", solution)
        assert number is not None
        changed = solution[: number.start()] + str(int(number.group().replace(",", "")) + 1)
        out.append((RewardRequest("gsm8k", changed, gold), 0.0))
    return out


def symbolic_requests(quick: bool) -> list[tuple[RewardRequest, float]]:
    cases = [case for k in range(1, 6 if quick else 26) for case in _symbolic_cases(k)]
    return [(RewardRequest("math", f"\\boxed{{{r}}}", g), float(same)) for r, g, same in cases]


def code_requests(quick: bool) -> list[tuple[RewardRequest, float]]:
    out = []
    for row in _rows("humaneval", "humaneval.jsonl", "humaneval_head20.jsonl", 20, quick):
        ref = json.dumps({"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]})
        out.append((RewardRequest("humaneval", row["canonical_solution"], ref), 1.0))
        out.append((RewardRequest("humaneval", "    pass\n", ref), 0.0))
    return out


async def _throughput(service: RewardService, cases: list[tuple[RewardRequest, float]]) -> tuple[float, int]:
    """(rewards per second, wrong verdicts), with every group in flight at once."""
    requests = [request for request, _ in cases]
    groups = [requests[i : i + GROUP_SIZE] for i in range(0, len(requests), GROUP_SIZE)]
    start = time.perf_counter()
    results = [r for group in await asyncio.gather(*map(service.score_group, groups)) for r in group]
    elapsed = time.perf_counter() - start
    wrong = sum(1 for (_, expected), r in zip(cases, results, strict=True) if r.reward != expected)
    return len(requests) / elapsed, wrong


async def _run(quick: bool) -> dict[str, float]:
    service = RewardService(RewardConfig(num_workers=NUM_WORKERS))
    service.start()
    try:
        # Warm-up: workers import their verifiers on start and build the LaTeX parser on first use;
        # that is start-up cost, not throughput. One request per worker (all idle: one each).
        await service.score_group([RewardRequest("math", "\\boxed{2\\sqrt{2}}", "\\sqrt{8}")] * NUM_WORKERS)
        metrics: dict[str, float] = {"reward/bench_workers": float(NUM_WORKERS)}
        wrong_total = 0
        for key, cases in (
            ("reward/math_per_s", math_requests(quick)),
            ("reward/math_symbolic_per_s", symbolic_requests(quick)),
            ("reward/code_per_s", code_requests(quick)),
        ):
            metrics[key], wrong = await _throughput(service, cases)
            wrong_total += wrong
        metrics["reward/bench_wrong_verdicts"] = float(wrong_total)
        metrics["reward/bench_sandbox_errors"] = service.metrics()["reward/sandbox_errors"]
        return metrics
    finally:
        service.close()


def run(quick: bool = False) -> dict[str, float]:
    """Rewards per second for math (numeric and symbolic) and code, on NUM_WORKERS workers."""
    return asyncio.run(_run(quick))


if __name__ == "__main__":
    for name, value in run(quick="--quick" in sys.argv[1:]).items():
        print(f"{name} {value:.2f}")
