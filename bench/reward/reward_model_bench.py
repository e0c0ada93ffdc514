"""Reward-model throughput: answers scored per second by one reward-model server (reward.model.*).

The committed built-in reward model (areal_jobs/tasks/models/builtin_reward_model, a 2-layer
Qwen2ForSequenceClassification) on one SGLang server (CPU engine, 2 threads), scored through the
controller's own scorer (reward/model_scorer.py over rollout/reward_client.py) in groups of
G = 8 answers with every group in flight, as the rollout controller sends them. The answers are
held-out problems' worked solutions, right and with the warm start's misconception, so each one is
a real prompt + answer of the task's long-tailed lengths. Side by side on the same server:
reward.model.batch_size=16 (one /classify call scores 8 answers of a group) vs 1 (one call per
answer). The verifier's verdicts are counted beside: the agreement row says the scores are real.

    python -m bench --only reward_model      (python -m bench.reward.reward_model_bench [--quick])

`reward_model/answers_per_s` is what `reward.model.answers_per_s` wants for the planner's keep-up
check (launch/planning/fit/reward_plan.py), measured on the reward nodes' own hardware.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import secrets
import sys
import time
from pathlib import Path

from areal_jobs.api import RewardRequest
from areal_jobs.config import JobConfig, RewardConfig, RewardModelConfig, RewardSource, RolloutConfig
from areal_jobs.data.tokenizer import load_tokenizer
from areal_jobs.reward.model_scorer import ModelScorer
from areal_jobs.rollout.reward_client import ScoringClient
from areal_jobs.rollout.reward_server import server_slices
from areal_jobs.rollout.server import start_server
from areal_jobs.tasks import arith_task
from areal_jobs.tasks.warm_start.reward_model import PACKAGED_RM_DIR
from areal_jobs.transport.discovery import free_port

GROUP_SIZE = 8
THREADS = 2
LOG_DIR = Path(__file__).resolve().parents[2] / "runs" / "bench" / "logs"


def answers(n: int) -> list[tuple[RewardRequest, float]]:
    """`n` (request, verifier reward) pairs: held-out problems, right and misconceived answers."""
    rng = random.Random(0)
    out = []
    for i in range(n):
        p = arith_task.eval_problem_at(3, i // 2)
        text = p.solution if i % 2 == 0 else arith_task.worked_solution(p.start, p.ops, 0.0, rng, 1.0)[0]
        out.append(
            (
                RewardRequest("arith", text, str(p.answer), p.prompt),
                arith_task.reward(text, str(p.answer)).reward,
            )
        )
    return out


async def _rate(client: ScoringClient, model: RewardModelConfig, cases) -> tuple[float, float, dict]:
    """(answers/s, agreement with the verifier, scorer metrics) with every group in flight."""
    tok = load_tokenizer(model.path)
    scorer = ModelScorer(model, lambda: [client], tok.encode, tok.decode, max_input_tokens=512)
    requests = [r for r, _ in cases]
    groups = [requests[i : i + GROUP_SIZE] for i in range(0, len(requests), GROUP_SIZE)]
    start = time.perf_counter()
    results = [r for g in await asyncio.gather(*map(scorer.score_group, groups)) for r in g]
    elapsed = time.perf_counter() - start
    agree = sum((r.reward >= 0.5) == (label >= 1.0) for r, (_, label) in zip(results, cases, strict=True))
    return len(results) / elapsed, agree / len(results), scorer.metrics()


def run(quick: bool = False) -> dict[str, float]:
    model = RewardModelConfig(path=str(PACKAGED_RM_DIR), server_threads=THREADS)
    cfg = JobConfig(
        reward=RewardConfig(source=RewardSource.model, model=model),
        rollout=RolloutConfig(max_total_tokens=65536),
    )
    rollout, model_slice = server_slices(cfg)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    server = start_server(
        model.path, "127.0.0.1", free_port(), token, rollout, model_slice, LOG_DIR / "reward-model.log"
    )
    with contextlib.ExitStack() as stack:
        stack.callback(server.stop)
        server.wait_healthy(timeout_s=600)
        client = ScoringClient(model.engine, "rm0", server.url, token, model)
        cases = answers(64 if quick else 512)

        async def measure() -> dict[str, float]:
            try:
                await _rate(client, model, cases[:GROUP_SIZE])  # warm-up: first calls build caches
                out = {}
                for batch in (1, 16):
                    rate, agreement, metrics = await _rate(
                        client, dataclasses.replace(model, batch_size=batch), cases
                    )
                    key = "reward_model/answers_per_s" + ("" if batch == 16 else "_batch1")
                    out[key] = rate
                    out["reward_model/agreement"] = agreement
                    out["reward_model/failed"] = metrics["reward/model_failed"]
                out["reward_model/batching_gain"] = (
                    out["reward_model/answers_per_s"] / out["reward_model/answers_per_s_batch1"]
                )
                out["reward_model/answers"] = float(len(cases))
                out["reward_model/server_threads"] = float(THREADS)
                return out
            finally:
                await client.close()

        return asyncio.run(measure())


if __name__ == "__main__":
    for name, value in run(quick="--quick" in sys.argv[1:]).items():
        print(f"{name} {value:.3f}")
