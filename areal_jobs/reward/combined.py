"""The training reward from its sources (reward.source): the verifier, the reward model, or both.

    reward.source=verifier   the task's checker alone (the RewardService, unchanged)
    reward.source=model      the reward model's score alone; where the task has a checker it runs
                             too, for the reward/verifier_* metrics only (how far the policy
                             learns to exploit the model: the agreement and exploit rates)
    reward.source=combined   verifier_weight * verifier reward + model_weight * model score

A model failure (RewardStatus.model_error) fails the answer's reward whatever the weights: it is
left out of training (trainer/intake/batch.py), never a 0. A verifier status other than ok is kept (as
the verifier alone would report it), with the mixed reward.

Per-source metrics, cumulative counts so that a window is the difference of two rows
(bench/rm_exploit.py plots them): reward/verifier_answers, reward/verifier_correct;
reward/model_judged (both sources scored; reward/model_judged_score_sum: their model scores),
reward/model_agreed (the model's call, score >=
reward.model.correct_threshold, equals the verifier's), reward/model_positive (the model calls it
right), reward/model_exploited (the model calls it right, the verifier says wrong), and their
rates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from areal_jobs.api import UNSCORED_STATUSES, RewardRequest, RewardResult, RewardScorer, RewardStatus
from areal_jobs.config import RewardConfig, RewardSource


class CombinedScorer:
    """Satisfies api.RewardScorer. `has_checker(task)`: whether the verifier can score `task`."""

    def __init__(
        self,
        cfg: RewardConfig,
        model: RewardScorer,
        verifier: RewardScorer | None,
        has_checker: Callable[[str], bool],
    ) -> None:
        if cfg.source is RewardSource.verifier:
            raise ValueError(
                "CombinedScorer is for reward.source=model|combined; the verifier alone is RewardService"
            )
        self.source = cfg.source
        self.verifier_weight = cfg.verifier_weight
        self.model_weight = cfg.model_weight
        self.threshold = cfg.model.correct_threshold
        self.model = model
        self.verifier = verifier
        self.has_checker = has_checker
        self._c = dict.fromkeys(
            ("verifier_answers", "verifier_correct", "judged", "agreed", "positive", "exploited"), 0
        )
        self._judged_score_sum = 0.0

    async def score_group(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        checkable = [
            i for i, r in enumerate(requests) if self.verifier is not None and self.has_checker(r.task)
        ]
        if self.source is RewardSource.combined and len(checkable) < len(requests):
            missing = sorted({r.task for i, r in enumerate(requests) if i not in set(checkable)})
            raise ValueError(
                f"reward.source=combined needs a verifier for every task; {missing} have none: "
                "use reward.source=model"
            )
        model_results, verified = await asyncio.gather(
            self.model.score_group(requests),
            self.verifier.score_group([requests[i] for i in checkable]) if checkable else _nothing(),
        )
        by_index = dict(zip(checkable, verified, strict=True))
        out = []
        for i, m in enumerate(model_results):
            v = by_index.get(i)
            self._count(m, v)
            if m.status.value in UNSCORED_STATUSES:
                out.append(m)
            elif self.source is RewardSource.model:
                out.append(m)
            else:
                assert v is not None
                reward = self.verifier_weight * v.reward + self.model_weight * m.reward
                out.append(
                    RewardResult(
                        reward, v.status, f"verifier {v.reward:g} ({v.detail}); model {m.reward:.4g}"
                    )
                )
        return out

    def _count(self, m: RewardResult, v: RewardResult | None) -> None:
        if v is None or v.status in (
            RewardStatus.timeout,
            RewardStatus.sandbox_error,
            RewardStatus.grader_error,
        ):
            return  # no verdict of the verifier to compare with
        right = v.reward >= 1.0
        self._c["verifier_answers"] += 1
        self._c["verifier_correct"] += right
        if m.status is not RewardStatus.ok:
            return
        says_right = m.reward >= self.threshold
        self._c["judged"] += 1
        self._judged_score_sum += m.reward
        self._c["agreed"] += says_right == right
        self._c["positive"] += says_right
        self._c["exploited"] += says_right and not right

    def metrics(self) -> dict[str, float]:
        c = self._c
        out = {**(self.verifier.metrics() if self.verifier is not None else {}), **self.model.metrics()}
        out.update(
            {
                "reward/verifier_answers": float(c["verifier_answers"]),
                "reward/verifier_correct": float(c["verifier_correct"]),
                "reward/verifier_accuracy": c["verifier_correct"] / c["verifier_answers"]
                if c["verifier_answers"]
                else 0.0,
                "reward/model_judged": float(c["judged"]),
                "reward/model_agreed": float(c["agreed"]),
                "reward/model_positive": float(c["positive"]),
                "reward/model_exploited": float(c["exploited"]),
                "reward/model_judged_score_sum": self._judged_score_sum,
                "reward/model_agreement": c["agreed"] / c["judged"] if c["judged"] else 0.0,
                # of the answers the model calls right, the share the verifier says are wrong
                "reward/model_exploit_rate": c["exploited"] / c["positive"] if c["positive"] else 0.0,
            }
        )
        return out


async def _nothing() -> list[RewardResult]:
    return []
