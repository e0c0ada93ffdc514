"""The RL objective: staleness bound, batch shape, advantages and the PPO loss.

Every knob of the loss is one field here; docs/objective.md tables what each does, which peer
framework has it, its default and the test that pins it. Defaults are AReaL's decoupled PPO.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Advantage(enum.Enum):
    grpo = "grpo"  # (r - mean) / (std + eps) within the group
    drgrpo = "drgrpo"  # r - mean (Dr.GRPO: no std normalisation)
    rloo = "rloo"  # r - mean of the other G-1 samples


class AdvStd(enum.Enum):
    unbiased = "unbiased"  # sample std, N - 1 (AReaL >= 0.3.4, verl)
    biased = "biased"  # population std, N (AReaL before 0.3.4; this project before issue 10)


class BehavWeightMode(enum.Enum):
    """What happens to the behaviour weight w = exp(prox - behav) of off-policy tokens."""

    drop = "drop"  # AReaL: w > cap adds nothing but the token stays in the denominator
    truncate = "truncate"  # verl/slime TIS: w -> min(w, cap)
    seq_mask = "seq_mask"  # MIS: the whole sample is masked when exp(mean log w) leaves [mis_low, mis_high]


class LossAgg(enum.Enum):
    """How per-token losses become the batch loss (verl's loss_agg_mode)."""

    token_mean = "token_mean"  # sum / valid tokens of the whole (mini)batch
    seq_mean_token_mean = "seq_mean_token_mean"  # mean over samples of each sample's token mean
    seq_mean_token_sum = "seq_mean_token_sum"  # mean over samples of each sample's token sum
    # Dr.GRPO (the paper): sum / (samples * max_new_tokens). verl's seq-mean-token-sum-norm divides
    # each micro-batch's sum by max_new_tokens only, then by its gradient-accumulation count and DP
    # size: the same as this with one sample per micro-batch, else larger (docs/objective.md)
    seq_mean_token_sum_norm = "seq_mean_token_sum_norm"


class ProxLogp(enum.Enum):
    """Where the proximal log-probs p of decoupled PPO come from (AReaL prox_logp_method)."""

    # p = the pre-step policy's log-probs, exactly: the first minibatch's gradient pass runs the
    # pre-step weights, so its own log-probs (detached) are p and need no pass of their own; only
    # the samples of later minibatches (algo.ppo_minibatches > 1) get a no-grad pass before the
    # first optimiser step. With one minibatch (the default) this saves the whole proximal pass
    # (~25% of a train step), with the same loss and gradient as recompute up to rounding.
    current = "current"
    recompute = "recompute"  # a no-grad forward pass over every sample with the pre-step weights
    # AReaL's approximation, no extra forward pass: p = b + α (θ - b) per token, θ detached,
    # α = clamp((v - 1 - v_b) / (v - v_b), 0, 1) (0 where v_b >= v), v = the trainer's version
    loglinear = "loglinear"


class KLEstimator(enum.Enum):
    """Per-token estimate of KL(π || π_ref) from x = log π - log π_ref."""

    k1 = "k1"  # x
    k2 = "k2"  # x² / 2
    # exp(-x) - 1 + x (unbiased, >= 0), x clamped to [-20, 20] and the estimate to [-10, 10]:
    # verl's low_var_kl exactly, and AReaL's k3 (which clamps every estimator to [-10, 10])
    k3 = "k3"


class ImportanceLevel(enum.Enum):
    """What the PPO ratio r = π/π_prox is taken over."""

    token = "token"  # per token (PPO)
    # GSPO: one ratio per sample, exp(mean over its valid tokens of (θ - p)), the gradient through
    # the mean to every token; AReaL's importance_sampling_level=sequence (docs/objective.md)
    sequence = "sequence"


@dataclass
class AlgoConfig:
    """Staleness-bounded decoupled PPO (AReaL)."""

    max_staleness: int = 4  # eta: max policy versions between sampling a token and training on it
    # d >= 0: every batch trains on samples exactly d versions old (from version d on; before, on
    # version 0's: the ramp), for ablations whose x-axis must be the staleness the samples had.
    # Needs max_staleness = d. -1 = off (samples are 0..max_staleness old, oldest first)
    exact_delay: int = -1
    batch_size: int = 8  # B: prompt groups per training step
    group_size: int = 8  # G: sampled answers per prompt
    advantage: Advantage = Advantage.grpo
    adv_std: AdvStd = AdvStd.unbiased  # grpo's std within a group
    adv_eps: float = 1e-5  # grpo: (r - mean) / (std + adv_eps)
    adv_batch_norm: bool = False  # whiten advantages over the batch, token-weighted (AReaL adv_norm)
    clip_eps: float = 0.2  # PPO clip on r = exp(logp - prox_logp): lower side, 1 - clip_eps
    eps_clip_high: float = 0.0  # upper side 1 + eps_clip_high (DAPO clip-higher); 0 = clip_eps
    dual_clip_c: float = 0.0  # > 1: tokens with A < 0 lose at most c * |A| (dual clip); 0 = off
    decoupled: bool = True  # False: proximal = behaviour log-probs (standard PPO ablation)
    prox_logp: ProxLogp = ProxLogp.current  # decoupled only: how p is computed (ProxLogp above)
    behav_weight_mode: BehavWeightMode = BehavWeightMode.drop
    behav_weight_cap: float = 0.0  # drop / truncate: the cap on w; 0 = no cap (drop mode only)
    mis_low: float = 0.5  # seq_mask: keep a sample while exp(mean log w) is in [mis_low, mis_high]
    mis_high: float = 2.0
    loss_agg: LossAgg = LossAgg.token_mean
    kl_coef: float = 0.0  # > 0: kl_coef * KL(π || reference) added per token; reference = initial weights
    kl_estimator: KLEstimator = KLEstimator.k3
    importance_level: ImportanceLevel = ImportanceLevel.token  # sequence = GSPO's sequence ratio
    entropy_coef: float = 0.0  # > 0: entropy bonus, entropy_coef * H(π) per token subtracted from the loss
    # reward shaping before group advantages, as AReaL: r <- clip((r + reward_bias) * reward_scaling,
    # ±reward_clip), after the overlong penalty; reward_clip 0 = no clip (AReaL's default is 20)
    reward_scaling: float = 1.0
    reward_bias: float = 0.0
    reward_clip: float = 0.0
    filter_uniform_groups: bool = False  # DAPO dynamic sampling: all-equal-reward groups dropped and replaced
    max_discarded_groups: int = 64  # dynamic sampling: this many uniform groups in a row is an error
    overlong_buffer: int = 0  # DAPO soft overlong penalty over the last N tokens before max_new_tokens
    overlong_penalty: float = 1.0  # reward penalty at max_new_tokens (grows linearly over the buffer)
    mask_truncated: bool = False  # samples cut at max_new_tokens train no token (AReaL mask_no_eos_with_zero)
    ppo_minibatches: int = 1  # optimiser steps per batch; the clip keeps later ones near the proximal policy

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError("algo.max_staleness must be >= 0 (0 = synchronous)")
        if self.exact_delay < -1:
            raise ValueError("algo.exact_delay must be -1 (off) or a delay d >= 0 in versions")
        if self.exact_delay >= 0 and self.max_staleness != self.exact_delay:
            raise ValueError(
                f"algo.exact_delay={self.exact_delay} admits exactly one batch per version, d ahead: "
                f"set algo.max_staleness={self.exact_delay} too (it is {self.max_staleness})"
            )
        if self.batch_size < 1:
            raise ValueError("algo.batch_size must be >= 1")
        if self.group_size < 2:
            # drgrpo's r - mean of a one-answer group is 0 for every sample: a run that trains nothing
            raise ValueError(
                f"algo.group_size={self.group_size}: algo.advantage={Advantage(self.advantage).value} "
                "compares each answer with the other answers to its prompt, so a group of one has "
                "no advantage (drgrpo: always 0; grpo, rloo: undefined): set algo.group_size>=2"
            )
        if self.adv_eps <= 0:
            raise ValueError("algo.adv_eps must be > 0")
        if not 0.0 < self.clip_eps < 1.0:
            raise ValueError("algo.clip_eps must be in (0, 1)")
        if self.eps_clip_high != 0.0 and not self.clip_eps <= self.eps_clip_high < 10.0:
            raise ValueError("algo.eps_clip_high must be 0 (= algo.clip_eps) or in [algo.clip_eps, 10)")
        if self.dual_clip_c != 0.0 and self.dual_clip_c <= 1.0:
            raise ValueError("algo.dual_clip_c must be 0 (off) or > 1 (e.g. 3)")
        self.prox_logp = ProxLogp(self.prox_logp)
        # current and recompute are the same p; without decoupled there is no p to compute (p = b)
        if self.prox_logp is ProxLogp.loglinear and not self.decoupled:
            raise ValueError(
                "algo.prox_logp=loglinear stands in for the proximal policy of decoupled PPO: set "
                "algo.decoupled=true or leave algo.prox_logp=current"
            )
        if self.behav_weight_cap < 0:
            raise ValueError("algo.behav_weight_cap must be >= 0 (0 = no cap)")
        if self.behav_weight_mode is BehavWeightMode.truncate and self.behav_weight_cap <= 0:
            raise ValueError("algo.behav_weight_mode=truncate needs algo.behav_weight_cap > 0 (e.g. 2)")
        if self.behav_weight_mode is BehavWeightMode.seq_mask and not 0 <= self.mis_low < 1 < self.mis_high:
            raise ValueError("algo.behav_weight_mode=seq_mask needs 0 <= algo.mis_low < 1 < algo.mis_high")
        if self.kl_coef < 0:
            raise ValueError("algo.kl_coef must be >= 0")
        if self.entropy_coef < 0:
            raise ValueError("algo.entropy_coef must be >= 0 (0 = no entropy bonus)")
        if self.reward_scaling <= 0:
            raise ValueError("algo.reward_scaling must be > 0 (1 = unscaled)")
        if self.reward_clip < 0:
            raise ValueError("algo.reward_clip must be >= 0 (0 = no clip)")
        if self.max_discarded_groups < 1:
            raise ValueError("algo.max_discarded_groups must be >= 1")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ValueError("algo.overlong_buffer and algo.overlong_penalty must be >= 0")
        if not 1 <= self.ppo_minibatches <= self.batch_size * self.group_size:
            raise ValueError("algo.ppo_minibatches must be in [1, algo.batch_size * algo.group_size]")

    @property
    def clip_high(self) -> float:
        return self.eps_clip_high or self.clip_eps
