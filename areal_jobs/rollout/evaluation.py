"""Held-out evaluation on the rollout servers: one sample per prompt, scored by the reward pool.

Start and final evaluations run while no weights change, so every answer comes from one policy
version. A periodic evaluation runs beside training: an answer interrupted by a weight update is
continued (prompt + partial output) like a training sample, so evaluations finish however often
the weights change; the versions seen are reported with the result.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from areal_jobs.api import FinishReason, GenerateRequest, RewardRequest, RewardScorer
from areal_jobs.data.prompts import Prompt
from areal_jobs.rollout.engine_http import ServerCallError
from areal_jobs.rollout.server_pool import NoServerAvailable, ServerPool
from areal_jobs.samples import SampleRecord

logger = logging.getLogger(__name__)

_MAX_ATTEMPTS = 10_000  # one per weight update it lives through, at most


@dataclass(frozen=True)
class EvalSummary:
    accuracy: float  # share of prompts with reward 1
    mean_reward: float
    num_prompts: int
    min_version: int
    max_version: int
    by_bucket: dict[str, float] = field(default_factory=dict)  # accuracy per Prompt.bucket
    bucket_sizes: dict[str, int] = field(default_factory=dict)  # prompts per Prompt.bucket


async def evaluate(
    pool: ServerPool,
    scorer: RewardScorer,
    prompts: list[Prompt],
    decode,
    *,
    max_new_tokens: int,
    temperature: float,
    running: asyncio.Event,
    tag: str,
    concurrency: int = 64,
    stop_token_ids: tuple[int, ...] = (),
    stop: tuple[str, ...] = (),
    dump: Callable[[list[SampleRecord]], None] | None = None,
    decode_raw: Callable[[list[int]], str] | None = None,
) -> EvalSummary:
    limiter = asyncio.Semaphore(concurrency)

    async def one(i: int, prompt: Prompt) -> tuple[list[int], int, int, str]:
        output: list[int] = []
        first_version = None
        async with limiter:
            for attempt in range(_MAX_ATTEMPTS):
                await running.wait()
                try:
                    slot = pool.least_loaded()
                except NoServerAvailable:
                    await asyncio.sleep(1.0)
                    continue
                request = GenerateRequest(
                    rid=f"eval-{tag}-{i}.{attempt}",
                    input_ids=prompt.input_ids + output,
                    max_new_tokens=max_new_tokens - len(output),
                    temperature=temperature,
                    top_p=1.0,
                    stop_token_ids=stop_token_ids,
                    stop=stop,
                )
                slot.in_flight += 1
                try:
                    response = await slot.client.generate(request)
                except ServerCallError as exc:
                    if exc.is_client_error:
                        raise
                    if not await slot.client.healthy():
                        pool.mark_down(slot.index, str(exc))
                    continue
                finally:
                    slot.in_flight -= 1
                output += response.output_ids
                if first_version is None:
                    first_version = response.weight_version
                if response.finish_reason is not FinishReason.abort or len(output) >= max_new_tokens:
                    reason = "length" if response.finish_reason is not FinishReason.stop else "stop"
                    return output, first_version, response.weight_version, reason
            raise RuntimeError(f"evaluation prompt {i} was interrupted {_MAX_ATTEMPTS} times")

    outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    requests = [
        RewardRequest(p.reward_task, decode(ids), p.reference) for p, (ids, *_) in zip(prompts, outputs)
    ]
    results = await scorer.score_group(requests)
    rewards = [r.reward for r in results]
    versions = [v for _, _, v, _ in outputs]
    if dump is not None:
        raw = decode_raw or decode
        dump([
            SampleRecord(tag, versions[i] if versions else 0, raw(p.input_ids), raw(ids), r.reward,
                         r.status.value, v0, v1, reason)
            for i, (p, (ids, v0, v1, reason), r) in enumerate(zip(prompts, outputs, results))
        ])  # fmt: skip
    n = max(len(prompts), 1)
    by_bucket, sizes = bucket_accuracy([p.bucket for p in prompts], rewards)
    summary = EvalSummary(
        accuracy=sum(1.0 for r in rewards if r >= 1.0) / n,
        mean_reward=sum(rewards) / n,
        num_prompts=len(prompts),
        min_version=min(versions, default=0),
        max_version=max(versions, default=0),
        by_bucket=by_bucket,
        bucket_sizes=sizes,
    )
    logger.info(
        "eval %s: accuracy %.3f over %d prompts (versions %d..%d)",
        tag,
        summary.accuracy,
        n,
        summary.min_version,
        summary.max_version,
    )
    return summary


def bucket_accuracy(buckets: list[str], rewards: list[float]) -> tuple[dict[str, float], dict[str, int]]:
    """Accuracy and prompt count per non-empty bucket, in order of first appearance."""
    correct: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for bucket, r in zip(buckets, rewards):
        if bucket:
            sizes[bucket] = sizes.get(bucket, 0) + 1
            correct[bucket] = correct.get(bucket, 0) + (r >= 1.0)
    return {b: correct[b] / sizes[b] for b in sizes}, sizes
