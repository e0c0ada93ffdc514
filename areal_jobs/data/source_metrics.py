"""Per-source figures of a mixture (or of a file whose rows carry a data_source).

Training batches: `source/<name>/reward`, `/accuracy` (reward >= 1), `/length` (output tokens),
`/truncated` (share stopped by max_new_tokens) and `/samples`, over the batch's samples of that
source. Held-out: `eval/<name>/accuracy` at every evaluation; the end-of-run table has a row per
source (summary.json's `by_source`). Groups without a source add nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol


class _Sample(Protocol):
    reward: float
    num_tokens: int
    finish_reason: str


class _Group(Protocol):
    source: str
    samples: Sequence[_Sample]


def source_metrics(groups: Iterable[_Group]) -> dict[str, float]:
    """The batch's per-source metrics (flat `source/<name>/...` keys)."""
    by_source: dict[str, list[_Sample]] = {}
    for group in groups:
        if group.source:
            by_source.setdefault(group.source, []).extend(group.samples)
    out: dict[str, float] = {}
    for name, samples in by_source.items():
        n = len(samples)
        out[f"source/{name}/reward"] = sum(s.reward for s in samples) / n
        out[f"source/{name}/accuracy"] = sum(s.reward >= 1.0 for s in samples) / n
        out[f"source/{name}/length"] = sum(s.num_tokens for s in samples) / n
        out[f"source/{name}/truncated"] = sum(s.finish_reason == "length" for s in samples) / n
        out[f"source/{name}/samples"] = float(n)
    return out


def eval_source_metrics(by_source: dict[str, float], prefix: str = "eval") -> dict[str, float]:
    """Held-out accuracy per source: `eval/<name>/accuracy` (greedy: `eval/<name>/greedy_accuracy`)."""
    return {f"{prefix}/{name}/accuracy": float(acc) for name, acc in by_source.items()}
