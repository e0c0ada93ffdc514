"""Evaluation metrics over n scored samples per problem: pass@1, unbiased pass@k, greedy accuracy,
mean length and truncation rate. Pure functions of the scores, shared by `launch.evaluate` and the
periodic evaluation during training.

pass@k is the unbiased estimator of Chen et al. 2021 (HumanEval): from n samples of which c are
correct, the chance that k drawn without replacement contain a correct one,
1 - C(n-c, k) / C(n, k), computed as a product so that it never forms a huge binomial.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

CORRECT_REWARD = 1.0  # a sample counts as correct when its reward reaches this


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (k <= n).

    1 - C(n-c, k)/C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i): every factor is in [0, 1], so the
    product neither overflows nor loses the small differences a ratio of binomials would.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got n={n} c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n (samples per problem), got n={n} k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


@dataclass(frozen=True)
class ProblemScores:
    """One problem's samples: the reward and output length (tokens) of each, and whether each hit
    the token limit without finishing."""

    rewards: Sequence[float]
    lengths: Sequence[int]
    truncated: Sequence[bool]

    def __post_init__(self) -> None:
        if not (len(self.rewards) == len(self.lengths) == len(self.truncated)):
            raise ValueError("rewards, lengths and truncated must have one entry per sample")

    @property
    def num_correct(self) -> int:
        return sum(1 for r in self.rewards if r >= CORRECT_REWARD)


@dataclass(frozen=True)
class SampledMetrics:
    """Metrics of n samples per problem, averaged over problems (pass@*) or samples (the rest)."""

    num_problems: int
    samples_per_problem: int
    pass_at_1: float  # mean over problems of (correct samples / n): the mean accuracy of a sample
    pass_at_k: dict[int, float]  # k -> mean over problems of the unbiased estimator
    mean_reward: float
    mean_length_tokens: float
    truncation_rate: float  # share of samples stopped by the token limit


def sampled_metrics(problems: Sequence[ProblemScores], ks: Sequence[int]) -> SampledMetrics:
    """pass@1, pass@k for each k, mean reward, mean length and truncation rate.

    Every problem must have the same number of samples n (the estimator's n), and every k <= n.
    """
    if not problems:
        raise ValueError("no problems to evaluate")
    n = len(problems[0].rewards)
    if n == 0 or any(len(p.rewards) != n for p in problems):
        raise ValueError("every problem needs the same number (>= 1) of samples")
    count = len(problems)
    all_rewards = [r for p in problems for r in p.rewards]
    all_lengths = [x for p in problems for x in p.lengths]
    all_truncated = [t for p in problems for t in p.truncated]
    return SampledMetrics(
        num_problems=count,
        samples_per_problem=n,
        pass_at_1=math.fsum(p.num_correct / n for p in problems) / count,
        pass_at_k={k: math.fsum(pass_at_k(n, p.num_correct, k) for p in problems) / count for k in ks},
        mean_reward=math.fsum(all_rewards) / len(all_rewards),
        mean_length_tokens=math.fsum(all_lengths) / len(all_lengths),
        truncation_rate=sum(all_truncated) / len(all_truncated),
    )


def greedy_accuracy(rewards: Sequence[float]) -> float:
    """Share of problems whose one greedy (temperature 0) answer is correct."""
    if not rewards:
        raise ValueError("no greedy answers to score")
    return sum(1 for r in rewards if r >= CORRECT_REWARD) / len(rewards)
