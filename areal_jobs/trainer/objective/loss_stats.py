"""Sums the PPO loss reports per micro-batch; micro-batches, minibatches and ranks add them up
before `to_metrics` divides (a sample never straddles micro-batches, so sequence counts add too).

ppo/*: the trust-region step; mismatch/*: how far the proximal policy p is from the behaviour
policy b that sampled the tokens (train/inference mismatch plus staleness).

offpolicy/*: how far the policy *before this step* (π_pre, the trainer's weights as the step
begins) is from b, on every run and either objective, the mechanism by which staleness can
matter (docs/objective.md, "How much staleness can I allow"). With w = exp(log π_pre - b) per
token (the log-ratio clamped to ±20 as everywhere in loss.py):
    preclip_fraction        w outside [1 - clip_eps, 1 + clip_high] before any update: the
                            tokens on which naive PPO (clip around b) and decoupled PPO (clip
                            around π_pre, weighted by w) can differ; _adv_pos / _adv_neg: the
                            same share among tokens with A > 0 / A < 0
    preclip_cut_fraction    of those, the ones naive PPO's clip zeroes at the step's start
                            (A > 0 with w > 1 + clip_high, A < 0 with w < 1 - clip_eps): where the
                            two objectives' first gradients differ (besides the cap's drops)
    k3_kl                   w - 1 - log w: the k3 estimate of KL(b || π_pre)
    abs_log_w_mean/p99/max  |log w|; p99 from a fixed histogram (HIST_EDGES) summed over
                            micro-batches and ranks, reported as the upper edge of its bin
    ess                     (Σw)² / (n Σw²), the effective sample size of the weights, per token
    measured_fraction       share of the step's tokens with π_pre known (see `pre_logp` in
                            loss.py: all of them, except naive PPO and prox_logp=loglinear with
                            ppo_minibatches > 1, where the first minibatch's are: no extra pass)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch

# |log w| histogram: bin 0 is [0, 1e-4); bins 1..HIST_LOG_BINS split [1e-4, 20] evenly in log
# space (each bin's edges differ by a factor of (2e5)^(1/1000) = 1.0123, so a quantile is exact
# to 1.3% above 1e-4); the last bin also holds the clamp's 20 itself. Bin i is
# [HIST_EDGES[i], HIST_EDGES[i + 1]). 1,001 float64 per step and rank: 8 kB to all-reduce.
HIST_FLOOR, HIST_CEIL, HIST_LOG_BINS = 1e-4, 20.0, 1000
HIST_EDGES = np.concatenate([[0.0], np.geomspace(HIST_FLOOR, HIST_CEIL, HIST_LOG_BINS + 1)])
HIST_BINS = len(HIST_EDGES) - 1
_INNER_EDGES = torch.from_numpy(HIST_EDGES[1:-1].copy())  # bucketize's boundaries


def _zeros_hist() -> np.ndarray:
    return np.zeros(HIST_BINS, dtype=np.float64)


@dataclass
class LossStats:
    num_tokens: float = 0.0  # valid (unmasked) output tokens
    num_seqs: float = 0.0  # samples with at least one valid token
    clipped_tokens: float = (
        0.0  # tokens where the clipped branch is active (prime: masked; cispo: weight truncated)
    )
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
    # w = π_θ/π_b at the gradient pass (θ: the weights the step starts from), for algo.ess_step
    cur_w_sum: float = 0.0
    cur_w_sq_sum: float = 0.0
    # algo.objective=m2po: micro-batches, those whose M2 budget bound (a finite τ), Σ of their τ
    m2po_microbatches: float = 0.0
    m2po_bound_microbatches: float = 0.0
    m2po_tau_sum: float = 0.0
    # offpolicy/*: w = exp(log π_pre - b) on the tokens where π_pre is known (module docstring)
    pre_tokens: float = 0.0
    pre_pos_tokens: float = 0.0  # of those, A > 0
    pre_neg_tokens: float = 0.0  # A < 0
    preclip_tokens: float = 0.0
    preclip_pos_tokens: float = 0.0
    preclip_neg_tokens: float = 0.0
    preclip_cut_tokens: float = 0.0
    pre_k3_sum: float = 0.0
    pre_abs_log_w_sum: float = 0.0
    pre_w_sum: float = 0.0
    pre_w_sq_sum: float = 0.0
    pre_abs_log_w_max: float = 0.0  # reduced by max, not sum
    pre_abs_log_w_hist: np.ndarray = field(default_factory=_zeros_hist)  # HIST_EDGES bins

    MAX_FIELDS = ("pre_abs_log_w_max",)

    @classmethod
    def sum_fields(cls) -> list[str]:
        """The scalar fields that add up (every float field but MAX_FIELDS)."""
        return [f.name for f in fields(cls) if f.type == "float" and f.name not in cls.MAX_FIELDS]

    def add(self, other: LossStats) -> None:
        for name in self.sum_fields():
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in self.MAX_FIELDS:
            setattr(self, name, max(getattr(self, name), getattr(other, name)))
        self.pre_abs_log_w_hist = self.pre_abs_log_w_hist + other.pre_abs_log_w_hist

    def sums(self) -> np.ndarray:
        """Everything that reduces by sum, float64: the sum fields, then the histogram."""
        scalars = [getattr(self, name) for name in self.sum_fields()]
        return np.concatenate([np.asarray(scalars, dtype=np.float64), self.pre_abs_log_w_hist])

    def maxes(self) -> np.ndarray:
        return np.asarray([getattr(self, name) for name in self.MAX_FIELDS], dtype=np.float64)

    @classmethod
    def from_reduced(cls, sums, maxes) -> LossStats:
        """The inverse of (sums(), maxes()) after a sum and a max all-reduce over ranks."""
        sums, maxes = np.asarray(sums, dtype=np.float64), np.asarray(maxes, dtype=np.float64)
        names = cls.sum_fields()
        out = cls(**{name: float(v) for name, v in zip(names, sums[: len(names)], strict=True)})
        for name, value in zip(cls.MAX_FIELDS, maxes, strict=True):
            setattr(out, name, float(value))
        out.pre_abs_log_w_hist = sums[len(names) :].copy()
        return out

    def to_metrics(self) -> dict[str, float]:
        n = max(self.num_tokens, 1.0)
        s = max(self.num_seqs, 1.0)
        pre = max(self.pre_tokens, 1.0)
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
            "offpolicy/measured_fraction": self.pre_tokens / n,
            "offpolicy/preclip_fraction": self.preclip_tokens / pre,
            "offpolicy/preclip_fraction_adv_pos": self.preclip_pos_tokens / max(self.pre_pos_tokens, 1.0),
            "offpolicy/preclip_fraction_adv_neg": self.preclip_neg_tokens / max(self.pre_neg_tokens, 1.0),
            "offpolicy/preclip_cut_fraction": self.preclip_cut_tokens / pre,
            "offpolicy/k3_kl": self.pre_k3_sum / pre,
            "offpolicy/abs_log_w_mean": self.pre_abs_log_w_sum / pre,
            "offpolicy/abs_log_w_p99": hist_quantile(self.pre_abs_log_w_hist, 0.99),
            "offpolicy/abs_log_w_max": self.pre_abs_log_w_max,
            "offpolicy/ess": self.pre_w_sum**2 / (pre * self.pre_w_sq_sum) if self.pre_w_sq_sum > 0 else 1.0,
            # ESS of π_θ/π_b at each minibatch's start, over the step's tokens (algo.ess_step's measure)
            "ppo/step_ess": self.cur_w_sum**2 / (n * self.cur_w_sq_sum) if self.cur_w_sq_sum > 0 else 1.0,
            **self._m2po_metrics(),
        }

    def _m2po_metrics(self) -> dict[str, float]:
        """m2po/* (algo.objective=m2po only): per micro-batch, so they depend on how the backend
        splits the batch (the contract compares ppo/*, mismatch/*, offpolicy/* only)."""
        if self.m2po_microbatches == 0:
            return {}
        bound = self.m2po_bound_microbatches
        return {
            "m2po/bound_fraction": bound / self.m2po_microbatches,
            "m2po/tau_mean": self.m2po_tau_sum / bound if bound else 0.0,  # with bound_fraction 0
        }


def hist_quantile(hist: np.ndarray, q: float) -> float:
    """The upper edge of the bin where the cumulative count first reaches q of the total (0 when
    empty): never below the true quantile, at most one bin (a factor 1.0123) above it."""
    total = float(hist.sum())
    if total <= 0:
        return 0.0
    index = int(np.searchsorted(np.cumsum(hist), q * total - 1e-9 * total))
    return float(HIST_EDGES[min(index, HIST_BINS - 1) + 1])


OFFPOLICY_SUM_NAMES = (
    "pre_tokens", "pre_pos_tokens", "pre_neg_tokens", "preclip_tokens", "preclip_pos_tokens",
    "preclip_neg_tokens", "preclip_cut_tokens", "pre_k3_sum", "pre_abs_log_w_sum", "pre_w_sum",
    "pre_w_sq_sum", "pre_abs_log_w_max",
)  # fmt: skip


def offpolicy_sums(
    pre_logp: torch.Tensor | None,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    log_bound: float,
) -> torch.Tensor | None:
    """The offpolicy/* sums of one micro-batch as one float64 tensor on the device (None when π_pre
    is unknown there): OFFPOLICY_SUM_NAMES, then the |log w| histogram. All inputs [T]; mask 1 on
    valid tokens. It stays on the device so that the caller copies it to the host together with
    its own sums (ppo_loss: one copy per micro-batch); `offpolicy_from_host` reads it back."""
    if pre_logp is None:
        return None
    log_w = (pre_logp.detach().double() - behav_logp.detach().double()).clamp(-log_bound, log_bound)
    m = mask.double()
    w = torch.exp(log_w)
    pos, neg = (advantages > 0).double() * m, (advantages < 0).double() * m
    outside = ((w < 1.0 - clip_low) | (w > 1.0 + clip_high)).double() * m
    cut = ((advantages > 0) & (w > 1.0 + clip_high)) | ((advantages < 0) & (w < 1.0 - clip_low))
    abs_log_w = log_w.abs()
    sums = torch.stack(
        [
            m.sum(), pos.sum(), neg.sum(), outside.sum(), (outside * pos).sum(), (outside * neg).sum(),
            (cut.double() * m).sum(), ((w - 1.0 - log_w) * m).sum(), (abs_log_w * m).sum(), (w * m).sum(),
            (w * w * m).sum(), (abs_log_w * m).max() if m.numel() else m.new_zeros(()),
        ]
    )  # fmt: skip
    valid = abs_log_w[m > 0]
    bins = torch.bucketize(valid, _INNER_EDGES.to(valid.device), right=True)
    return torch.cat([sums, torch.bincount(bins, minlength=HIST_BINS).double()])


def offpolicy_from_host(values: np.ndarray) -> dict:
    """LossStats fields from `offpolicy_sums`'s tensor once it is on the host."""
    names = OFFPOLICY_SUM_NAMES
    out: dict = {name: float(v) for name, v in zip(names, values[: len(names)], strict=True)}
    out["pre_abs_log_w_hist"] = np.asarray(values[len(names) :], dtype=np.float64).copy()
    return out
