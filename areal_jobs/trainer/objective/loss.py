"""The decoupled PPO objective (AReaL, eq. 5) with the peers' standard switches, on packed
per-token tensors. One function, used by every backend.

Per output token, with behaviour log-prob b (from the rollout server), proximal log-prob p
(the pre-step policy's: algo.prox_logp, or b itself when algo.decoupled=false), current
log-prob θ and the sample's advantage A:
    r = exp(clamp(θ - p, ±20))                      trust-region ratio (log-ratio clamped as verl)
        importance_level=sequence (GSPO): r = exp(mean of θ - p over the sample's valid tokens)
    pg = max(-A r, -A clip(r, 1 - ε_low, 1 + ε_high))           clip-higher when ε_high > ε_low
    pg = min(pg, c |A|)            for A < 0 only                 dual clip, when c > 0
    w = exp(clamp(p - b, ±20))                      behaviour weight, corrected by the mode:
        drop      w > cap -> 0 (the token still counts in the denominator)
        truncate  w -> min(w, cap)
        seq_mask  w -> 0 on every token of a sample whose exp(mean log w) leaves [low, high]
    loss_t = w pg + kl_coef * k(θ - ref) - entropy_coef * H_t
        k = k1 / k2 / k3 estimator of KL(π || π_ref); H_t the policy's entropy at t (with gradient)
    loss = Σ_t a_t loss_t      a_t = the aggregation weight of `token_weights` (0 on masked tokens)
algo.objective (issue 42) swaps the policy term for another objective's: icepop and m2po_areal
mask w like the modes above; m2po clips r to π_b with a width chosen per micro-batch; prime and
cispo replace pg (objectives.py has each one's definition). Their anchor is π_b: the backends then
pass b as p (algo.decoupled is false for them), so r = π_θ/π_b and w = 1.
The a_t are fixed by the whole (mini)batch before the step, so micro-batch losses add up over
micro-batches and data-parallel ranks to exactly the batch loss: gradients are summed, never
averaged. All tensors are 1-D over the tokens of a micro-batch: [T].
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from areal_jobs.config.algo import (
    AlgoConfig,
    BehavWeightMode,
    ImportanceLevel,
    KLEstimator,
    LossAgg,
    Objective,
    ProxLogp,
)
from areal_jobs.trainer.objective.loss_stats import LossStats, offpolicy_from_host, offpolicy_sums
from areal_jobs.trainer.objective.objectives import (
    band_outside,
    cispo_terms,
    m2po_areal_masked,
    m2po_clip,
    per_seq,
    prime_terms,
)

__all__ = ["LossStats", "kl_estimate", "loglinear_prox_logp", "ppo_loss", "pre_step_logp", "token_weights"]

# |p - b| beyond this is clamped before exp: verl's SAFETY_BOUND (rollout correction, its TIS and
# MIS weights). Without it float32 exp overflows at ~88.7 and drop mode's inf * 0 is NaN.
BEHAV_LOG_RATIO_BOUND = 20.0
# |θ - p| beyond this is clamped before exp: verl's compute_policy_loss clamps the log-ratio to
# ±20 the same way. Unclamped, float32 exp(90) is inf: the loss stays finite (the clipped branch
# wins the max) but torch.maximum's backward multiplies the losing branch's inf by 0: a NaN
# gradient. Past the bound the clip has long taken over, so no gradient is lost that PPO keeps.
RATIO_LOG_BOUND = 20.0
# k3: verl's low_var_kl clamps x to ±20 before exp and the estimate to [-10, 10] (AReaL: the same
# [-10, 10] on the estimate), so a token far from the reference adds at most 10, with no gradient
K3_LOG_RATIO_BOUND = 20.0
K3_BOUND = 10.0


def token_weights(masks: Sequence[np.ndarray], agg: LossAgg, max_new_tokens: int = 0) -> list[np.ndarray]:
    """Aggregation weight a_t of every output token of every sample of one optimiser step.

    masks: per sample, 1 on trained output tokens, 0 on masked ones ([n_i]). Samples with no
    valid token are not counted in the sequence means. Returns float64 [n_i] per sample.
    """
    masks = [np.asarray(m, dtype=np.float64) for m in masks]
    valid = [float(m.sum()) for m in masks]
    num_seqs = sum(v > 0 for v in valid)
    out = []
    for m, v in zip(masks, valid, strict=True):
        if v == 0:
            out.append(np.zeros_like(m))
        elif agg is LossAgg.token_mean:
            out.append(m / sum(valid))
        elif agg is LossAgg.seq_mean_token_mean:
            out.append(m / (num_seqs * v))
        elif agg is LossAgg.seq_mean_token_sum:
            out.append(m / num_seqs)
        elif agg is LossAgg.seq_mean_token_sum_norm:
            if max_new_tokens < 1:
                raise ValueError("loss_agg=seq_mean_token_sum_norm needs the batch's max_new_tokens")
            # Dr.GRPO: a constant normaliser, the same for every sample whatever its length
            out.append(m / (len(masks) * max_new_tokens))
        else:  # pragma: no cover - Enum is exhaustive
            raise ValueError(f"unknown loss aggregation {agg}")
    return out


def kl_estimate(x: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """x = log π - log π_ref per token -> the estimator's per-token KL(π || π_ref).
    k1 and k2 unclamped (verl); k3 clamped as verl's low_var_kl (module constants)."""
    if estimator is KLEstimator.k1:
        return x
    if estimator is KLEstimator.k2:
        return 0.5 * x * x
    x = x.clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return (torch.exp(-x) - 1.0 + x).clamp(-K3_BOUND, K3_BOUND)


def loglinear_prox_logp(
    behav_logp: torch.Tensor, logp: torch.Tensor, versions: torch.Tensor, trainer_version: int
) -> torch.Tensor:
    """AReaL's `loglinear` proximal log-probs (areal/trainer/ppo/actor.py,
    compute_prox_logp_approximations): no forward pass, p = b + α (θ - b) per token, with
        v_θ = trainer_version (the version the batch is trained at: AReaL's engine.get_version()),
        v_prox = v_θ - 1, α = clamp((v_prox - v_b) / (v_θ - v_b), 0, 1), and α = 0 where
        v_b >= v_θ (a token of the current weights: p = b) or v_b < 0 (no generation version).
    So tokens 0 or 1 versions behind keep p = b; 2 behind get α = 1/2, 3 behind 2/3, ...
    behav_logp, logp [T] (logp is detached here), versions int [T]. Returns logp's dtype [T].

    b is first held within ±BEHAV_LOG_RATIO_BOUND of θ, the bound the recomputed path's behaviour
    weight has: a behaviour log-prob of -inf (a token the server sampled at probability 0 in float32)
    would otherwise give -inf + α·inf = NaN, and with α = 0 a p of -inf and p - b = NaN. A b within
    the bound, every real one, is used bit for bit.
    """
    dtype = logp.dtype
    v_b = versions.to(dtype)
    span = float(trainer_version) - v_b
    usable = (span > 0) & (versions >= 0)
    alpha = torch.where(usable, (span - 1.0) / torch.where(usable, span, torch.ones_like(span)), 0.0)
    alpha = alpha.clamp(0.0, 1.0)
    theta = logp.detach()
    behav = behav_logp.detach().to(dtype)
    behav = torch.minimum(torch.maximum(behav, theta - BEHAV_LOG_RATIO_BOUND), theta + BEHAV_LOG_RATIO_BOUND)
    return behav + alpha * (theta - behav)


_per_seq = per_seq


def ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    token_weight: torch.Tensor,
    seq_index: torch.Tensor,
    algo: AlgoConfig,
    *,
    entropy: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    pre_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Loss contribution of one micro-batch and its statistics (sums).

    token_weight: a_t from `token_weights` (0 = masked token). seq_index: int64, which sample of
    the micro-batch each token belongs to (0, 0, 1, 1, 1, ...); a sample never straddles
    micro-batches (the sequence ratio and seq_mask need all its tokens). entropy: the current
    policy's token entropy, reported, and with algo.entropy_coef > 0 a loss term (it must then
    carry gradient). ref_logp: needed when algo.kl_coef > 0. pre_logp: the log-probs of the
    policy as this optimiser step began (π_pre), where the backend has them without an extra
    pass (`pre_step_logp`); only the offpolicy/* statistics read them (loss_stats.py), None = not
    known for this micro-batch.
    """
    shape = logp.shape
    if not (
        prox_logp.shape
        == behav_logp.shape
        == advantages.shape
        == token_weight.shape
        == seq_index.shape
        == shape
    ):
        raise ValueError(
            "logp, prox_logp, behav_logp, advantages, token_weight and seq_index must share one shape [T]"
        )
    if algo.kl_coef > 0 and ref_logp is None:
        raise ValueError("algo.kl_coef > 0 needs the reference log-probs")
    if algo.entropy_coef > 0 and entropy is None:
        raise ValueError("algo.entropy_coef > 0 needs the policy's token entropy")
    dtype = logp.dtype
    weight = token_weight.to(dtype)
    mask = (weight > 0).to(dtype)
    prox_logp, behav_logp = prox_logp.detach().to(dtype), behav_logp.detach().to(dtype)
    num_seqs = int(seq_index.max()) + 1 if seq_index.numel() else 0

    # clamped: a behaviour log-prob of -inf (or far below p) must not make inf, nor inf * 0 = NaN
    log_w = (prox_logp - behav_logp).clamp(-BEHAV_LOG_RATIO_BOUND, BEHAV_LOG_RATIO_BOUND)
    behav_weight = torch.exp(log_w)
    corrected, affected = behav_weight, torch.zeros_like(mask)
    mode, cap = algo.behav_weight_mode, algo.behav_weight_cap
    if mode is BehavWeightMode.drop and cap > 0:
        over = behav_weight > cap
        affected = mask * over.to(dtype)
        corrected = torch.where(over, torch.zeros_like(behav_weight), behav_weight)
    elif mode is BehavWeightMode.truncate:
        affected = mask * (behav_weight > cap).to(dtype)
        corrected = torch.clamp(behav_weight, max=cap)
    elif mode is BehavWeightMode.seq_mask:
        counts = _per_seq(mask, seq_index, num_seqs)
        geo_mean = torch.exp(_per_seq(log_w * mask, seq_index, num_seqs) / counts.clamp(min=1))
        outside = ((geo_mean < algo.mis_low) | (geo_mean > algo.mis_high)) & (counts > 0)
        affected = mask * outside.to(dtype)[seq_index]
        corrected = behav_weight * (1 - affected)

    objective = algo.loss_objective
    if objective in (Objective.m2po, Objective.prime, Objective.cispo):
        # anchored on π_b: the backends pass b as p (algo.decoupled is false); a caller's p is ignored
        prox_logp = behav_logp
        log_w = torch.zeros_like(log_w)
        behav_weight, corrected, affected = (
            torch.ones_like(mask),
            torch.ones_like(mask),
            torch.zeros_like(mask),
        )
    if objective is Objective.icepop:  # no gradient where w leaves the band (on top of the mode)
        outside = band_outside(log_w, mask, seq_index, num_seqs, algo)
        affected = torch.maximum(affected, outside)
        corrected = corrected * (1 - outside)
    elif objective is Objective.m2po_areal:  # the staleness filter of AReaL's port, on (b - p)²
        masked = m2po_areal_masked(log_w, mask, algo.m2_budget)
        affected = torch.maximum(affected, masked)
        corrected = corrected * (1 - masked)

    low, high, tau = 1.0 - algo.clip_eps, 1.0 + algo.clip_high, None
    if objective is Objective.m2po:  # p = b here (decoupled false): the clip is around π_b
        low, high, tau = m2po_clip(logp - behav_logp, advantages, mask, algo)
    log_ratio = (logp - prox_logp).clamp(-RATIO_LOG_BOUND, RATIO_LOG_BOUND)
    if algo.importance_level is ImportanceLevel.sequence:
        # GSPO as AReaL: the sample's geometric-mean ratio on each of its tokens, its gradient
        # spread over the tokens through the mean (masked tokens take no part)
        counts = _per_seq(mask, seq_index, num_seqs)
        log_ratio = (_per_seq(log_ratio * mask, seq_index, num_seqs) / counts.clamp(min=1))[seq_index]
    ratio = torch.exp(log_ratio)
    pg_plain = -advantages * ratio
    pg_clipped = -advantages * torch.clamp(ratio, low, high)
    pg = torch.maximum(pg_plain, pg_clipped)
    clipped = (pg_clipped > pg_plain).to(dtype)
    dual = torch.zeros_like(mask)
    if algo.dual_clip_c > 0:
        bound = -algo.dual_clip_c * advantages  # c |A| where A < 0
        dual = ((advantages < 0) & (pg > bound)).to(dtype)
        pg = torch.where(advantages < 0, torch.minimum(pg, bound), pg)
    if objective is Objective.prime:
        pg, ratio, clipped = prime_terms(logp, behav_logp, advantages, mask, algo, RATIO_LOG_BOUND)
    elif objective is Objective.cispo:
        pg, ratio, clipped = cispo_terms(logp, behav_logp, advantages, mask, algo, RATIO_LOG_BOUND)
    per_token = corrected * pg
    kl = torch.zeros_like(mask)
    if algo.kl_coef > 0:
        kl = kl_estimate(logp - ref_logp.detach().to(dtype), algo.kl_estimator)
        per_token = per_token + algo.kl_coef * kl
    if algo.entropy_coef > 0:
        per_token = per_token - algo.entropy_coef * entropy.to(dtype)
    loss = (per_token * weight).sum()

    with torch.no_grad():
        counts = _per_seq(mask, seq_index, num_seqs)
        # one device-to-host copy for all the sums, the offpolicy ones included (a float() each
        # would synchronise each time)
        entropy_t = entropy.detach().to(dtype) if entropy is not None else torch.zeros_like(mask)
        # w = π_θ/π_b at the gradient pass (θ: the weights this optimiser step starts from): the
        # ESS-scaled step's weights (objectives.ess_lr_scale), known on every minibatch for free
        cur_w = torch.exp((logp.detach() - behav_logp).clamp(-BEHAV_LOG_RATIO_BOUND, BEHAV_LOG_RATIO_BOUND))
        sums = torch.stack(
            [
                mask.sum(), (counts > 0).to(dtype).sum(), (clipped * mask).sum(),
                (dual * mask).sum(), (ratio * mask).sum(), (behav_weight * mask).sum(),
                ((prox_logp - logp) * mask).sum(), (entropy_t * mask).sum(), (kl * mask).sum(),
                (log_w.abs() * mask).sum(), ((behav_weight - 1 - log_w) * mask).sum(), affected.sum(),
                (_per_seq(affected, seq_index, num_seqs) > 0).to(dtype).sum(),
                (cur_w * mask).sum(), (cur_w * cur_w * mask).sum(),
            ]
        ).double()  # fmt: skip
        names = ("num_tokens", "num_seqs", "clipped_tokens", "dual_clipped_tokens", "ratio_sum",
                 "behav_weight_sum", "approx_kl_sum", "entropy_sum", "kl_ref_sum", "abs_diff_sum",
                 "k3_sum", "affected_tokens", "affected_seqs", "cur_w_sum", "cur_w_sq_sum")  # fmt: skip
        off = offpolicy_sums(
            pre_logp, behav_logp, advantages, mask, algo.clip_eps, algo.clip_high, BEHAV_LOG_RATIO_BOUND
        )
        values = (sums if off is None else torch.cat([sums, off])).cpu().numpy()
        offpolicy = {} if off is None else offpolicy_from_host(values[len(names) :])
        stats = LossStats(
            **{n: float(v) for n, v in zip(names, values[: len(names)], strict=True)}, **offpolicy
        )
        if objective is Objective.m2po:  # per micro-batch: how often the budget bound, how tight
            stats.m2po_microbatches, stats.m2po_bound_microbatches = 1.0, float(tau is not None)
            stats.m2po_tau_sum = tau or 0.0
    return loss, stats


def pre_step_logp(
    algo: AlgoConfig, prox_logp: torch.Tensor, logp: torch.Tensor, first_minibatch: bool
) -> torch.Tensor | None:
    """π_pre for the offpolicy/* statistics, at no extra forward pass: the proximal log-probs when
    they are the pre-step policy's (decoupled with prox_logp current or recompute); otherwise the
    gradient pass's own log-probs on the first minibatch (its weights are the pre-step ones), and
    None on later minibatches (naive PPO, loglinear: their π_pre would need a pass of its own)."""
    if algo.decoupled and algo.prox_logp is not ProxLogp.loglinear:
        return prox_logp
    return logp.detach() if first_minibatch else None
