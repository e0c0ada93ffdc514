"""Group-relative advantages. One scalar per sample, broadcast to its tokens by the caller.

For rewards r_1..r_G of one prompt's G samples, with mean m and standard deviation s:
  GRPO      A_i = (r_i - m) / (s + eps)
  Dr.GRPO   A_i = r_i - m                         (no std: no bias toward easy/hard prompts)
  RLOO      A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - m)
A group whose rewards are all equal carries no signal: every advantage is exactly 0.
"""

from __future__ import annotations

import numpy as np

from areal_jobs.config import Advantage

_EPS = 1e-6


def group_advantages(rewards: np.ndarray, kind: Advantage) -> np.ndarray:
    """rewards: float [G] -> advantages: float32 [G]."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D array, got shape {r.shape}")
    if kind is Advantage.rloo and r.size < 2:
        raise ValueError("RLOO needs at least 2 samples per group (algo.group_size>=2)")
    if is_uniform(r):
        # the mean of equal floats need not equal them (0.7 * 6 / 6 != 0.7): no signal is exactly 0
        return np.zeros(r.size, dtype=np.float32)
    centred = r - r.mean()
    if kind is Advantage.grpo:
        adv = centred / (r.std() + _EPS)
    elif kind is Advantage.drgrpo:
        adv = centred
    elif kind is Advantage.rloo:
        adv = centred * r.size / (r.size - 1)
    else:  # pragma: no cover - Enum is exhaustive
        raise ValueError(f"unknown advantage {kind}")
    return adv.astype(np.float32)


def is_uniform(rewards: np.ndarray) -> bool:
    r = np.asarray(rewards)
    return bool(np.all(r == r[0]))
