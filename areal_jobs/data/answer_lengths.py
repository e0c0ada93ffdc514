"""Answer lengths of prompt groups as the few numbers the simulator's length model needs.

The simulator (launch/planning/sim) draws answer lengths as a lognormal per prompt and a lognormal per
sample around it. Its three parameters follow from three statistics of ln(tokens): the mean, the
pooled variance inside groups and the variance of the groups' means. The trainer logs them every
step (`gen/len_log_*`), so a re-planner that only reads the metrics stream can fit the model
without seeing a single answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

_KEYS = ("gen/len_log_mean", "gen/len_log_var_within", "gen/len_log_var_between", "gen/len_group_size")


@dataclass(frozen=True)
class LengthStats:
    """ln(output tokens) of the answers of some prompt groups (an answer of 0 tokens counts as 1)."""

    log_mean: float  # mean over every answer
    log_var_within: float  # pooled variance inside groups (n - 1 degrees of freedom per group)
    log_var_between: float  # variance (population) of the groups' mean ln(tokens)
    group_size: float  # mean answers per group

    @classmethod
    def of_groups(cls, groups: Sequence[Sequence[int]]) -> LengthStats:
        if not groups or any(len(g) == 0 for g in groups):
            raise ValueError("answer lengths: need at least one non-empty group")
        logs = [np.log(np.maximum(np.asarray(g, dtype=float), 1.0)) for g in groups]
        within = sum(float(((x - x.mean()) ** 2).sum()) for x in logs)
        dof = sum(len(x) - 1 for x in logs)
        means = np.array([x.mean() for x in logs])
        return cls(
            log_mean=float(np.concatenate(logs).mean()),
            log_var_within=within / dof if dof > 0 else 0.0,
            log_var_between=float(means.var()),
            group_size=float(np.mean([len(x) for x in logs])),
        )

    @property
    def prompt_var(self) -> float:
        """Variance of the per-prompt log median: the spread of group means less the share the
        sample spread puts there (var / G)."""
        return max(0.0, self.log_var_between - self.log_var_within / self.group_size)

    def metrics(self) -> dict[str, float]:
        values = (self.log_mean, self.log_var_within, self.log_var_between, self.group_size)
        return dict(zip(_KEYS, values, strict=True))

    @classmethod
    def from_metrics(cls, rows: Iterable[dict[str, float]]) -> LengthStats | None:
        """The mean of each statistic over the rows that carry all of them (steps train batches of
        the same size, so the plain mean pools them); None when no row does."""
        found = [[row[k] for k in _KEYS] for row in rows if all(k in row for k in _KEYS)]
        if not found:
            return None
        return cls(*(float(v) for v in np.mean(np.asarray(found, dtype=float), axis=0)))
