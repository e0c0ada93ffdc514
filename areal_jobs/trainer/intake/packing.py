"""Packing sequences without padding, and micro-batches balanced under a token budget.

Balanced allocation: k micro-batches, sequences placed largest first into the micro-batch that
holds the fewest tokens (LPT scheduling). k starts at ceil(total / budget) and grows until no
micro-batch exceeds the budget, so every micro-batch carries nearly the same number of tokens.
`naive_microbatches` (fill in arrival order, start a new one when full) is the baseline the
benchmark compares against.

Packed layout of one micro-batch with sequences of lengths L_1..L_k (T = sum L_i):
  input_ids [T], position_ids [T] restarting at 0 per sequence, cu_seqlens [k + 1].
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def balanced_microbatches(
    lengths: Sequence[int], max_tokens: int, *, min_count: int = 1, multiple_of: int = 1
) -> list[list[int]]:
    """Indices of `lengths` grouped into micro-batches of at most `max_tokens` tokens each.

    `min_count` / `multiple_of` let data-parallel ranks agree on a common number of
    micro-batches (Megatron's schedules need the same count on every rank).
    """
    if not lengths:
        return []
    too_long = [n for n in lengths if n > max_tokens]
    if too_long:
        raise ValueError(
            f"a sequence of {max(too_long)} tokens exceeds the micro-batch budget of {max_tokens}: "
            f"raise trainer.max_tokens_per_microbatch to at least {max(too_long)}"
        )
    if min_count < 1 or multiple_of < 1:
        raise ValueError("min_count and multiple_of must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    count = max(min_count, math.ceil(sum(lengths) / max_tokens))
    count = _round_up(count, multiple_of)
    while True:
        bins = _lpt(order, lengths, count)
        if max(sum(lengths[i] for i in b) for b in bins) <= max_tokens:
            return [sorted(b) for b in bins]
        count += multiple_of


def naive_microbatches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Fill micro-batches in arrival order; a new one starts when the next sequence won't fit."""
    bins: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"a sequence of {n} tokens exceeds the micro-batch budget of {max_tokens}")
        if not bins or used + n > max_tokens:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += n
    return bins


def imbalance(lengths: Sequence[int], bins: list[list[int]]) -> float:
    """max / mean tokens per micro-batch (1.0 = perfectly balanced)."""
    loads = [sum(lengths[i] for i in b) for b in bins]
    return max(loads) / (sum(loads) / len(loads))


@dataclass(frozen=True)
class Packed:
    input_ids: np.ndarray  # int64 [T]
    position_ids: np.ndarray  # int64 [T]
    cu_seqlens: np.ndarray  # int64 [k + 1]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def pack(sequences: Sequence[np.ndarray]) -> Packed:
    """Concatenate sequences with no padding; positions restart at 0 for every sequence."""
    if not sequences:
        raise ValueError("cannot pack an empty micro-batch")
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    cu = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences])
    return Packed(input_ids=ids, position_ids=positions, cu_seqlens=cu)


def _lpt(order: list[int], lengths: Sequence[int], count: int) -> list[list[int]]:
    heap = [(0, b) for b in range(count)]  # (tokens, bin index): ties go to the lower index
    bins: list[list[int]] = [[] for _ in range(count)]
    for i in order:
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return [b for b in bins if b]  # fewer sequences than bins: empty ones are dropped


def _round_up(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple
