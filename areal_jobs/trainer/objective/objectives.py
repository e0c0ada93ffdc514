"""The off-policy objectives of issue 42 beside decoupled PPO (docs/objective.md, "Objectives for
stale data"): each one's mask, clip width or term on packed per-token tensors [T], called by
`ppo_loss` (loss.py) on one micro-batch, so every backend runs them. Pure torch, no GPU stack.

Notation: θ the current log-probs (with gradient), p the proximal, b the behaviour ones, A the
advantage, `mask` 1 on the micro-batch's valid tokens. Log-ratios are clamped to ±bound before
exp, as everywhere in loss.py (verl's SAFETY_BOUND), so a far-off token never makes inf or NaN.
"""

from __future__ import annotations

import math

import torch

from areal_jobs.config.algo import AlgoConfig, EssStep, MaskLevel

# M2PO's official code compares with these margins (kpo_clip_harmful_tokens, _solve_tau_from_sorted_delta2)
M2PO_EPS = 1e-12


def per_seq(values: torch.Tensor, seq_index: torch.Tensor, num_seqs: int) -> torch.Tensor:
    return torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add_(0, seq_index, values)


def band_outside(
    log_w: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, num_seqs: int, algo: AlgoConfig
) -> torch.Tensor:
    """icepop: 1 on the valid tokens whose w = exp(log_w) leaves [icepop_low, icepop_high] (token
    level), or all of a sample's tokens when its geometric-mean w exp(mean log w) leaves it
    (sequence level, verl's seq_mean_k1); else 0. [T] in mask's dtype."""
    if algo.icepop_level is MaskLevel.token:
        w = torch.exp(log_w)
        return mask * ((w < algo.icepop_low) | (w > algo.icepop_high)).to(mask.dtype)
    counts = per_seq(mask, seq_index, num_seqs)
    geo = torch.exp(per_seq(log_w * mask, seq_index, num_seqs) / counts.clamp(min=1))
    out = ((geo < algo.icepop_low) | (geo > algo.icepop_high)) & (counts > 0)
    return mask * out.to(mask.dtype)[seq_index]


def m2po_tau(harmful_sq: torch.Tensor, budget: float) -> float | None:
    """M2PO's clip width for one micro-batch (official `kpo_clip_harmful_tokens`): harmful_sq the
    (log π_θ/π_b)² of its harmful tokens. None (no clip) when there are none or their mean is
    within the budget; else τ such that capping every value at τ² keeps the mean under the budget,
    taken, as the official code does, at the largest breakpoint (a value of harmful_sq) that does:
    sorted ascending v_0..v_{n-1}, k the first index with (v_k - 1e-12)(n - k - 1) + Σ_{i<=k} v_i
    >= n·budget - 1e-12, and τ = sqrt(v_{k-1} - 1e-12) (τ = 0 when k = 0)."""
    v = harmful_sq.detach().double().flatten()
    n = v.numel()
    if n == 0 or float(v.sum()) / n <= budget + M2PO_EPS:
        return None
    v, _ = torch.sort(v)
    csum = torch.cumsum(v, 0)
    rest = torch.arange(n - 1, -1, -1, dtype=v.dtype, device=v.device)  # n - k - 1
    reach = (v - M2PO_EPS) * rest + csum >= budget * n - M2PO_EPS
    k = int(torch.argmax(reach.to(torch.int8)))  # reach[n - 1] holds: the total exceeds n·budget
    return 0.0 if k == 0 else math.sqrt(max(float(v[k - 1]) - M2PO_EPS, 0.0))


def m2po_clip(log_r: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, algo: AlgoConfig):
    """The official M2PO clip range (1 - ε_low, 1 + ε_high) of one micro-batch from the detached
    log-ratio to the behaviour policy: harmful tokens are A > 0 with r > 1 and A < 0 with r < 1
    (1e-12 margins); ε_low = 1 - e^-τ, ε_high = e^τ - 1, then the optional floor/cap
    (m2po_min_eps_low, m2po_max_eps_high). Returns (low, high, τ or None)."""
    d = log_r.detach()
    valid = mask > 0
    pos, neg = advantages > M2PO_EPS, advantages < -M2PO_EPS
    r = torch.exp(d)
    harmful = valid & ((pos & (r > 1.0 + M2PO_EPS)) | (neg & (r < 1.0 - M2PO_EPS)))
    tau = m2po_tau((d * d)[harmful], algo.m2_budget)
    eps_low, eps_high = (1.0, math.inf) if tau is None else (1.0 - math.exp(-tau), math.exp(tau) - 1.0)
    if algo.m2po_min_eps_low > 0 and eps_low < algo.m2po_min_eps_low:
        eps_low = algo.m2po_min_eps_low
    if algo.m2po_max_eps_high > 0 and eps_high > algo.m2po_max_eps_high:
        eps_high = algo.m2po_max_eps_high
    return 1.0 - eps_low, 1.0 + eps_high, tau


def m2po_areal_masked(log_w: torch.Tensor, mask: torch.Tensor, budget: float) -> torch.Tensor:
    """AReaL's M2PO port (`_apply_m2po_masking`): m = (b - p)² on the valid tokens, sorted
    descending; the first j of them are masked, j the first index whose suffix mean (the mean of
    the values from j on) is below the budget (n - 1 when none is: one token stays). Returns 1 on
    the masked tokens [T]."""
    valid = mask > 0
    m2 = (log_w.detach() ** 2)[valid]
    n = m2.numel()
    out = torch.zeros_like(mask)
    if n == 0:
        return out
    sorted_m2, order = torch.sort(m2, descending=True)
    suffix = sorted_m2.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=m2.dtype, device=m2.device)
    below = torch.nonzero(suffix < budget)
    j = int(below[0]) if below.numel() else n - 1
    masked_sorted = torch.zeros(n, dtype=mask.dtype, device=mask.device)
    masked_sorted[:j] = 1.0
    masked = torch.empty_like(masked_sorted).scatter_(0, order, masked_sorted)
    out[valid] = masked
    return out


def prime_terms(logp, behav_logp, advantages, mask, algo: AlgoConfig, bound: float):
    """prime-rl's default loss per token: -keep·A·r + prime_kl_coef·(log r)², r = π_θ/π_b with
    gradient, keep = 0 where the probability moved since sampling past the band in A's direction
    (A > 0 and π_θ - π_b > prime_mask_high, or A <= 0 and π_θ - π_b < -prime_mask_low: prime-rl's
    torch.where on A > 0). The KL term is on every valid token, masked ones too.
    Returns (per-token loss, ratio, masked [T] 1/0)."""
    log_r = logp - behav_logp
    ratio = torch.exp(log_r.clamp(-bound, bound))
    diff = torch.exp(logp.detach()) - torch.exp(behav_logp)
    invalid = torch.where(advantages > 0, diff > algo.prime_mask_high, diff < -algo.prime_mask_low)
    masked = mask * invalid.to(mask.dtype)
    per_token = -(1.0 - masked) * advantages * ratio + algo.prime_kl_coef * log_r * log_r
    return per_token, ratio, masked


def cispo_terms(logp, behav_logp, advantages, mask, algo: AlgoConfig, bound: float):
    """CISPO per token: -sg(clip(r, 1 - cispo_eps_low, 1 + cispo_eps_high))·A·log π_θ, r = π_θ/π_b;
    the weight is detached, so every token keeps the gradient -weight·A·∇log π_θ.
    Returns (per-token loss, ratio, truncated [T] 1/0)."""
    ratio = torch.exp((logp.detach() - behav_logp).clamp(-bound, bound))
    low, high = max(0.0, 1.0 - algo.cispo_eps_low), 1.0 + algo.cispo_eps_high
    weight = ratio.clamp(min=low, max=high)
    truncated = mask * ((ratio > high) | (ratio < low)).to(mask.dtype)
    return -weight * advantages * logp, ratio, truncated


def ess(w_sum: float, w_sq_sum: float, n: float) -> float:
    """(Σw)² / (n Σw²) in (0, 1]; 1 with no token."""
    return w_sum * w_sum / (n * w_sq_sum) if n > 0 and w_sq_sum > 0 else 1.0


def ess_lr_scale(algo: AlgoConfig, w_sum: float, w_sq_sum: float, n: float) -> float:
    """The factor on the learning rate of one optimiser step (algo.ess_step): sqrt(ESS), ESS, or 1,
    from the sums over the minibatch's valid tokens on every rank of w = π_θ/π_b at the step's
    start (LossStats.cur_w_sum, cur_w_sq_sum, num_tokens)."""
    if algo.ess_step is EssStep.off:
        return 1.0
    value = ess(w_sum, w_sq_sum, n)
    return math.sqrt(value) if algo.ess_step is EssStep.sqrt else value


def set_lr_scale(optimizer, scale: float) -> None:
    """Every param group's lr = its base lr (remembered at the first call) x scale."""
    for group in optimizer.param_groups:
        base = group.setdefault("ess_base_lr", group["lr"])
        group["lr"] = base * scale


def step_lr_scale(algo: AlgoConfig, optimizer, step_stats, reduce=None) -> float:
    """algo.ess_step on one optimiser step: the scale from the step's LossStats (its
    micro-batches on this rank; `reduce` sums [w, w², n] over the ranks when there are several)
    set on `optimizer`'s lr; returns it (1, the optimiser untouched, when off)."""
    if algo.ess_step is EssStep.off:
        return 1.0
    sums = [step_stats.cur_w_sum, step_stats.cur_w_sq_sum, step_stats.num_tokens]
    if reduce is not None:
        sums = reduce(sums)
    scale = ess_lr_scale(algo, *sums)
    set_lr_scale(optimizer, scale)
    return scale
