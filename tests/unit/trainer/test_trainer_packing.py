"""Packing without padding, and balanced micro-batches under a token budget."""

import numpy as np
import pytest

from areal_jobs.trainer.intake.packing import balanced_microbatches, imbalance, naive_microbatches, pack


def long_tail_lengths(n, seed):
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.pareto(1.2, n) * 40 + 20, 20, 900)]


@pytest.mark.parametrize("seed", range(5))
def test_every_sequence_once_and_budget_respected(seed):
    lengths = long_tail_lengths(64, seed)
    bins = balanced_microbatches(lengths, 1024)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(64))
    assert all(sum(lengths[i] for i in b) <= 1024 for b in bins)
    assert len(bins) >= -(-sum(lengths) // 1024)


@pytest.mark.parametrize("seed", range(5))
def test_balanced_beats_naive(seed):
    lengths = long_tail_lengths(128, seed)
    balanced = balanced_microbatches(lengths, 2048)
    naive = naive_microbatches(lengths, 2048)
    assert imbalance(lengths, balanced) <= imbalance(lengths, naive) + 1e-9
    assert imbalance(lengths, balanced) < 1.15


def test_min_count_and_multiple_of():
    lengths = [10] * 7
    bins = balanced_microbatches(lengths, 1000, min_count=3)
    assert len(bins) == 3
    assert sorted(len(b) for b in bins) == [2, 2, 3]
    assert len(balanced_microbatches([100] * 10, 250, multiple_of=4)) % 4 == 0


def test_too_long_sequence_names_the_override():
    with pytest.raises(ValueError, match="trainer.max_tokens_per_microbatch"):
        balanced_microbatches([10, 5000], 4096)


def test_pack_layout():
    packed = pack([np.array([7, 8, 9]), np.array([1]), np.array([4, 5])])
    assert packed.input_ids.tolist() == [7, 8, 9, 1, 4, 5]
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert packed.num_tokens == 6
    with pytest.raises(ValueError):
        pack([])
