"""The decoupled PPO objective (AReaL, eq. 5), on packed per-token tensors.

Per output token, with behaviour log-prob b (from the rollout server), proximal log-prob p
(recomputed by the trainer before the step) and current log-prob θ:
    r = exp(θ - p)                      (trust-region ratio, clipped)
    w = exp(p - b)                      (importance weight for off-policy data, not clipped)
    loss_t = -w * min(r * A, clip(r, 1 - ε, 1 + ε) * A)
The batch loss is the sum over tokens divided by the number of output tokens in the whole
global batch (every micro-batch and data-parallel rank), so gradients accumulated over
micro-batches and averaged over DP ranks equal the token-mean over the batch.
Setting p = b gives standard PPO (w = 1).
All tensors are 1-D over the tokens of a micro-batch: [T].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossStats:
    """Sums over tokens, so micro-batches and ranks add up before dividing by `num_tokens`."""

    num_tokens: float = 0.0
    clipped_tokens: float = 0.0  # tokens where the clipped branch is active
    capped_tokens: float = 0.0  # tokens dropped by the behaviour-weight cap
    ratio_sum: float = 0.0
    behav_weight_sum: float = 0.0
    approx_kl_sum: float = 0.0  # p - θ, first-order KL(prox || current)

    def add(self, other: LossStats) -> None:
        for key, value in vars(other).items():
            setattr(self, key, getattr(self, key) + value)

    def to_metrics(self) -> dict[str, float]:
        n = max(self.num_tokens, 1.0)
        return {
            "ppo/clip_fraction": self.clipped_tokens / n,
            "ppo/capped_fraction": self.capped_tokens / n,
            "ppo/ratio_mean": self.ratio_sum / n,
            "ppo/behav_weight_mean": self.behav_weight_sum / n,
            "ppo/approx_kl": self.approx_kl_sum / n,
        }


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
    num_global_tokens: float,
    behav_weight_cap: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """Loss contribution of one micro-batch. `mask` is 1 on output tokens that are trained."""
    if not (logp.shape == prox_logp.shape == behav_logp.shape == advantages.shape == mask.shape):
        raise ValueError("logp, prox_logp, behav_logp, advantages and mask must share one shape [T]")
    if num_global_tokens <= 0:
        raise ValueError("num_global_tokens must be > 0")
    mask = mask.to(logp.dtype)
    prox_logp = prox_logp.detach()
    behav_logp = behav_logp.detach()
    ratio = torch.exp(logp - prox_logp)
    behav_weight = torch.exp(prox_logp - behav_logp)
    if behav_weight_cap > 0:
        keep = (behav_weight <= behav_weight_cap).to(mask.dtype)
        capped = mask * (1 - keep)
        mask = mask * keep
    else:
        capped = torch.zeros_like(mask)
    surr = ratio * advantages
    surr_clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -behav_weight * torch.minimum(surr, surr_clipped)
    loss = (per_token * mask).sum() / num_global_tokens
    with torch.no_grad():
        stats = LossStats(
            num_tokens=float(mask.sum()),
            clipped_tokens=float(((surr_clipped < surr).to(mask.dtype) * mask).sum()),
            capped_tokens=float(capped.sum()),
            ratio_sum=float((ratio * mask).sum()),
            behav_weight_sum=float((behav_weight * mask).sum()),
            approx_kl_sum=float(((prox_logp - logp) * mask).sum()),
        )
    return loss, stats
