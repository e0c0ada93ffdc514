"""Sums the PPO loss reports per micro-batch; micro-batches, minibatches and ranks add them up
before `to_metrics` divides (a sample never straddles micro-batches, so sequence counts add too).

ppo/*: the trust-region step; mismatch/*: how far the proximal policy p is from the behaviour
policy b that sampled the tokens (train/inference mismatch plus staleness).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossStats:
    num_tokens: float = 0.0  # valid (unmasked) output tokens
    num_seqs: float = 0.0  # samples with at least one valid token
    clipped_tokens: float = 0.0  # tokens where the clipped branch is active
    dual_clipped_tokens: float = 0.0  # A < 0 tokens held at c * |A| by the dual clip
    ratio_sum: float = 0.0  # r = exp(θ - p)
    behav_weight_sum: float = 0.0  # w = exp(p - b) before any correction
    approx_kl_sum: float = 0.0  # p - θ, first-order KL(prox || current)
    entropy_sum: float = 0.0  # token entropy of the current policy
    kl_ref_sum: float = 0.0  # the chosen estimator of KL(current || reference), 0 when off
    abs_diff_sum: float = 0.0  # |p - b|
    k3_sum: float = 0.0  # w - 1 - log w: k3 estimate of KL(b || p) from tokens sampled by b
    affected_tokens: float = 0.0  # tokens dropped, truncated or masked by the behaviour-weight mode
    affected_seqs: float = 0.0  # samples with at least one affected token

    def add(self, other: LossStats) -> None:
        for key, value in vars(other).items():
            setattr(self, key, getattr(self, key) + value)

    def to_metrics(self) -> dict[str, float]:
        n = max(self.num_tokens, 1.0)
        s = max(self.num_seqs, 1.0)
        return {
            "ppo/clip_fraction": self.clipped_tokens / n,
            "ppo/dual_clip_fraction": self.dual_clipped_tokens / n,
            "ppo/capped_fraction": self.affected_tokens / n,
            "ppo/ratio_mean": self.ratio_sum / n,
            "ppo/behav_weight_mean": self.behav_weight_sum / n,
            "ppo/approx_kl": self.approx_kl_sum / n,
            "ppo/entropy": self.entropy_sum / n,
            "ppo/kl_ref": self.kl_ref_sum / n,
            "mismatch/abs_diff_mean": self.abs_diff_sum / n,
            "mismatch/k3_kl": self.k3_sum / n,
            "mismatch/token_fraction": self.affected_tokens / n,
            "mismatch/seq_fraction": self.affected_seqs / s,
        }
