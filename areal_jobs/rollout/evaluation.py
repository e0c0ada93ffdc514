"""Evaluation on the rollout servers: n answers per problem, scored by the reward functions.

Answers go through the training samples' own GenerationPath (failover, continuation after an
interruption, version stamping), with its own counters so evaluation tokens do not count as
rollout throughput. Start and final evaluations in a run, and `launch.evaluate`, run while no
weights change, so every answer comes from one policy version; a periodic evaluation runs beside
training and its answers are continued across updates like training samples, and the versions
seen are reported with the result.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

from areal_jobs.agent.context import EpisodeContext, EpisodeServices, run_episode
from areal_jobs.agent.episode import EpisodeState
from areal_jobs.api import FinishReason, RewardRequest, RewardScorer
from areal_jobs.config import WorkflowConfig
from areal_jobs.data.prompts import Prompt
from areal_jobs.rollout.eval_metrics import ProblemScores, sampled_metrics
from areal_jobs.rollout.generation import GenerationPath, Sampling
from areal_jobs.samples import SampleRecord

logger = logging.getLogger(__name__)


# (prompt, state, sampling, request id) -> None: one held-out episode of the run's workflow,
# leaving its reward and reward status on the state
EvalEpisode = Callable[[Prompt, EpisodeState, Sampling, str], Awaitable[None]]


def workflow_episodes(
    workflow, config: WorkflowConfig, services: EpisodeServices, path: GenerationPath
) -> EvalEpisode:
    """Held-out episodes of `workflow`: the training episodes' services (text, reward, tools), with
    every model turn on `path` under the evaluation's sampling."""

    async def episode(prompt: Prompt, state: EpisodeState, sampling: Sampling, rid: str) -> None:
        async def generate(rid_: str, prompt_ids: list[int], state_: EpisodeState, max_new_tokens: int, stop):
            stop = sampling.stop if stop is None else tuple(stop)
            return await path.run(
                rid_, prompt_ids, state_, replace(sampling, max_new_tokens=max_new_tokens, stop=stop)
            )

        ctx = EpisodeContext(prompt, config, state, replace(services, generate=generate), rid)
        await run_episode(workflow, ctx)

    return episode


@dataclass(frozen=True)
class EvalSummary:
    accuracy: float  # pass@1: the mean over problems of the share of correct samples
    mean_reward: float
    num_prompts: int
    min_version: int
    max_version: int
    samples_per_problem: int = 1
    pass_at_k: dict[int, float] | None = None  # k -> unbiased pass@k (k <= samples_per_problem)
    mean_length_tokens: float = 0.0
    truncation_rate: float = 0.0  # share of samples stopped by max_new_tokens
    by_bucket: dict[str, float] = field(default_factory=dict)  # accuracy per Prompt.bucket
    bucket_sizes: dict[str, int] = field(default_factory=dict)  # prompts per Prompt.bucket
    by_source: dict[str, float] = field(default_factory=dict)  # accuracy per Prompt.source (mixtures)
    source_sizes: dict[str, int] = field(default_factory=dict)  # prompts per Prompt.source


@dataclass(frozen=True)
class ProblemResult:
    """One problem's answers, for the per-problem rows `launch.evaluate` writes."""

    index: int
    reference: str
    texts: list[str]
    rewards: list[float]
    lengths: list[int]
    truncated: list[bool]


@dataclass(frozen=True)
class EvalOutcome:
    summary: EvalSummary
    problems: list[ProblemResult]


async def evaluate_problems(
    path: GenerationPath,
    scorer: RewardScorer,
    prompts: Sequence[Prompt],
    decode: Callable[[list[int]], str],
    *,
    sampling: Sampling,
    samples_per_problem: int = 1,
    ks: Sequence[int] = (),
    tag: str,
    concurrency: int = 64,
    dump: Callable[[list[SampleRecord]], None] | None = None,
    decode_raw: Callable[[list[int]], str] | None = None,
    episode: EvalEpisode | None = None,
) -> EvalOutcome:
    """n answers per prompt through `path`, scored by `scorer`; pass@1 and pass@k for each k.
    `episode`: each answer is an episode of the run's workflow (RolloutController.eval_episodes),
    which generates on `path` and scores itself; None: one turn each, scored in one batch."""
    if not prompts:
        raise ValueError("no prompts to evaluate")
    n = samples_per_problem
    limiter = asyncio.Semaphore(concurrency)
    nonce = uuid.uuid4().hex[:8]  # request ids stay unique on a server shared across evaluations
    states = [[EpisodeState(f"{i}/{j}") for j in range(n)] for i in range(len(prompts))]

    async def one(prompt: Prompt, state: EpisodeState) -> None:
        async with limiter:
            rid = f"eval-{tag}-{nonce}-{state.sample_id}"
            if episode is None:
                await path.run(rid, prompt.input_ids, state, sampling)
            else:
                await episode(prompt, state, sampling, rid)

    version_before = path.version()
    await asyncio.gather(*(one(p, s) for p, row in zip(prompts, states) for s in row))
    requests = [
        RewardRequest(
            p.reward_task,
            decode(s.output_ids),
            p.reference,
            (decode_raw or decode)(p.input_ids),
            p.data_source,
            p.extra_info,
        )  # fmt: skip
        for p, row in zip(prompts, states)
        for s in row
    ]
    if episode is None:
        results = await scorer.score_group(requests)
        rewards, statuses = [r.reward for r in results], [r.status.value for r in results]
    else:  # the workflow scored its episode
        rewards = [s.reward for row in states for s in row]
        statuses = [s.reward_status for row in states for s in row]
    problems = []
    for i, (prompt, row) in enumerate(zip(prompts, states)):
        problems.append(
            ProblemResult(
                index=i,
                reference=prompt.reference,
                texts=[requests[i * n + j].response for j in range(n)],
                rewards=rewards[i * n : (i + 1) * n],
                lengths=[len(s.output_ids) for s in row],
                truncated=[s.finish_reason == FinishReason.length.value for s in row],
            )
        )
    ks = sorted({k for k in ks if k <= n} | {1})
    metrics = sampled_metrics([ProblemScores(p.rewards, p.lengths, p.truncated) for p in problems], ks)
    versions = [v for row in states for s in row for v in s.versions] or [version_before]
    if dump is not None:
        raw = decode_raw or decode
        dump([
            SampleRecord(tag, version_before, raw(p.input_ids), raw(s.output_ids), reward, status,
                         min(s.versions, default=version_before), max(s.versions, default=version_before),
                         "stop" if s.finish_reason == FinishReason.stop.value else "length")
            for (p, s), reward, status in zip(
                ((p, s) for p, row in zip(prompts, states) for s in row), rewards, statuses
            )
        ])  # fmt: skip
    by_bucket, sizes = bucket_accuracy(
        [p.bucket for p in prompts], [sum(r >= 1.0 for r in p.rewards) / n for p in problems]
    )
    by_source, source_sizes = bucket_accuracy(
        [p.source for p in prompts], [sum(r >= 1.0 for r in p.rewards) / n for p in problems]
    )
    summary = EvalSummary(
        accuracy=metrics.pass_at_1,
        mean_reward=metrics.mean_reward,
        num_prompts=len(prompts),
        min_version=min(versions),
        max_version=max(versions),
        samples_per_problem=n,
        pass_at_k=metrics.pass_at_k,
        mean_length_tokens=metrics.mean_length_tokens,
        truncation_rate=metrics.truncation_rate,
        by_bucket=by_bucket,
        bucket_sizes=sizes,
        by_source=by_source,
        source_sizes=source_sizes,
    )
    logger.info(
        "eval %s: pass@1 %.3f, %s over %d prompts x %d samples (versions %d..%d)",
        tag, summary.accuracy,
        ", ".join(f"pass@{k} {v:.3f}" for k, v in metrics.pass_at_k.items() if k > 1) or "-",
        len(prompts), n, summary.min_version, summary.max_version,
    )  # fmt: skip
    return EvalOutcome(summary, problems)


async def evaluate(
    path: GenerationPath, scorer: RewardScorer, prompts: Sequence[Prompt], decode, **kwargs
) -> EvalSummary:
    """`evaluate_problems` without the per-problem rows."""
    return (await evaluate_problems(path, scorer, prompts, decode, **kwargs)).summary


def bucket_accuracy(buckets: list[str], accuracies: list[float]) -> tuple[dict[str, float], dict[str, int]]:
    """Mean per-prompt accuracy and prompt count per non-empty bucket, in order of first appearance."""
    total: dict[str, float] = {}
    sizes: dict[str, int] = {}
    for bucket, accuracy in zip(buckets, accuracies):
        if bucket:
            sizes[bucket] = sizes.get(bucket, 0) + 1
            total[bucket] = total.get(bucket, 0.0) + float(accuracy)
    return {b: total[b] / sizes[b] for b in sizes}, sizes
