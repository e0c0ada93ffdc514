"""Group-relative advantages. One scalar per sample, broadcast to its tokens by the caller.

For rewards r_1..r_G of one prompt's G samples, with mean m and standard deviation s:
  GRPO      A_i = (r_i - m) / (s + eps)     s unbiased (N - 1, AReaL's default) or biased (N)
  Dr.GRPO   A_i = r_i - m                         (no std: no bias toward easy/hard prompts)
  RLOO      A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - m)
A group whose rewards are all equal carries no signal: every advantage is exactly 0.
Optionally (`algo.adv_batch_norm`) the batch is then whitened token-weighted, as AReaL's adv_norm:
  A_i <- (A_i - μ) / (σ + eps),  μ, σ = mean and unbiased std over every trained token.
"""

from __future__ import annotations

import numpy as np

from areal_jobs.config import Advantage
from areal_jobs.config.algo import AdvStd


def group_advantages(
    rewards: np.ndarray, kind: Advantage, std: AdvStd = AdvStd.unbiased, eps: float = 1e-5
) -> np.ndarray:
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
        ddof = 1 if std is AdvStd.unbiased and r.size > 1 else 0
        adv = centred / (r.std(ddof=ddof) + eps)
    elif kind is Advantage.drgrpo:
        adv = centred
    elif kind is Advantage.rloo:
        adv = centred * r.size / (r.size - 1)
    else:  # pragma: no cover - Enum is exhaustive
        raise ValueError(f"unknown advantage {kind}")
    return adv.astype(np.float32)


def whiten(advantages: np.ndarray, num_tokens: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """Token-weighted batch whitening of per-sample advantages [S] with trained-token counts [S]."""
    a = np.asarray(advantages, dtype=np.float64)
    w = np.asarray(num_tokens, dtype=np.float64)
    total = w.sum()
    if total < 2:
        return np.zeros_like(a, dtype=np.float32)
    mean = (a * w).sum() / total
    std = np.sqrt(((a - mean) ** 2 * w).sum() / (total - 1))
    return ((a - mean) / (std + eps)).astype(np.float32)


def overlong_penalty(num_tokens: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO soft overlong punishment: 0 up to max_new_tokens - buffer, then growing linearly,
    `penalty` at max_new_tokens and on at the same slope beyond (an episode longer than one
    turn's cap), as verl's DAPO reward manager and AReaL's reward_overlong_penalty do."""
    if buffer <= 0:
        return 0.0
    excess = num_tokens - (max_new_tokens - buffer)
    return penalty * max(excess, 0) / buffer


def shape_rewards(rewards: np.ndarray, scaling: float, bias: float, clip: float) -> np.ndarray:
    """AReaL's reward scaling (areal/trainer/ppo/actor.py): (r + bias) * scaling, then clipped to
    [-clip, clip] (clip 0 = no clip). rewards float [G] -> float64 [G]."""
    shaped = (np.asarray(rewards, dtype=np.float64) + bias) * scaling
    return np.clip(shaped, -clip, clip) if clip > 0 else shaped


def is_uniform(rewards: np.ndarray) -> bool:
    r = np.asarray(rewards)
    return bool(np.all(r == r[0]))
