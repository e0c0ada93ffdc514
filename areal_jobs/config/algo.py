"""The RL objective: staleness bound, batch shape, advantages and the PPO loss.

Every knob of the loss is one field here; docs/objective.md tables what each does, which peer
framework has it, its default and the test that pins it. Defaults are AReaL's decoupled PPO.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


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


class DriftMeasure(enum.Enum):
    """algo.max_staleness=auto: the trainer's drift measure the bound follows (loss_stats.py)."""

    preclip = "preclip"  # offpolicy/preclip_fraction: share of tokens with w outside the clip range
    ess = "ess"  # 1 - offpolicy/ess: one minus the behaviour weights' effective sample size


class Objective(enum.Enum):
    """The policy-gradient objective (docs/objective.md, "Objectives for stale data": source,
    anchor and defaults of each). Which policy anchors the trust region: π_b the behaviour policy
    (the sampler), π_p the proximal one (the weights as the step begins)."""

    # follow algo.decoupled (the keys before issue 42): decoupled, or ppo with algo.decoupled=false
    auto = "auto"
    ppo = "ppo"  # PPO clip around π_b (algo.decoupled=false): the ablation's "naive"
    decoupled = "decoupled"  # AReaL: clip around π_p, times w = π_p / π_b (and the behaviour-weight mode)
    # decoupled, and no gradient where w leaves [icepop_low, icepop_high] (per token, or per
    # sample on its geometric-mean w): IcePop, verl rollout rejection, AReaL rejection_sampling
    icepop = "icepop"
    # M2PO's official code: PPO clip around π_b whose width [e^-τ, e^τ] is chosen per micro-batch
    # so that the harmful tokens' mean (log π_θ/π_b)² capped at τ² is within algo.m2_budget
    m2po = "m2po"
    # AReaL's port of M2PO: decoupled, after masking the tokens of largest (log π_p/π_b)² until
    # the rest's mean is under algo.m2_budget (per micro-batch)
    m2po_areal = "m2po_areal"
    # prime-rl's default loss: -keep·A·(π_θ/π_b) + prime_kl_coef·(log π_θ/π_b)², keep = 0 where
    # the token's probability moved past ±prime_mask_high/low since sampling in A's direction
    prime = "prime"
    # CISPO (MiniMax-M1, ScaleRL): -sg(clip(π_θ/π_b, 1 - cispo_eps_low, 1 + cispo_eps_high))·A·log π_θ
    cispo = "cispo"

    @property
    def needs_prox(self) -> bool:
        """Whether the loss reads π_p (the backends compute it; else they pass π_b in its place)."""
        return self in (Objective.decoupled, Objective.icepop, Objective.m2po_areal)


class MaskLevel(enum.Enum):
    """What a behaviour-ratio mask tests: each token's w, or its sample's geometric-mean w."""

    token = "token"
    sequence = "sequence"


class EssStep(enum.Enum):
    """VCPO-style step size: the learning rate of each optimiser step times f(ESS), ESS the
    effective sample size (Σw)² / (n Σw²) of w = π_θ/π_b over the minibatch's tokens, θ the
    weights the step starts from (reduced over every rank before the step)."""

    off = "off"
    sqrt = "sqrt"  # lr · sqrt(ESS): VCPO's rule for AdamW-style optimisers
    linear = "linear"  # lr · ESS (for SGD-like steps)


@dataclass
class AlgoConfig:
    """Staleness-bounded PPO: naive (clipped around the behaviour policy) by default, AReaL's
    decoupled objective and the issue-42 objectives as knobs (docs/objective.md)."""

    # eta: max policy versions between sampling a token and training on it; or "auto" (the bound
    # follows the drift, up to staleness_ceiling: the fields at the end). Any, not int: OmegaConf 2.3
    # has no int | str union; __post_init__ leaves an int here (the ceiling under auto)
    max_staleness: Any = 4
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
    # true: AReaL's decoupled PPO (clip around π_p, times w = π_p / π_b); false: PPO clipped around
    # the behaviour policy, the default since issue 42 (docs/objective.md, "Which objective"): it
    # beat the decoupled objective wherever staleness acted (11 of 11 pairs at delay 8) and equals
    # it on fresh data, without the proximal forward pass. An algo.objective other than auto sets
    # it to what that objective needs
    decoupled: bool = False
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
    # algo.max_staleness=auto: the controller moves the admission bound between staleness_floor and
    # staleness_ceiling from the drift the trainer measures (areal_jobs/staleness_bound.py has the law)
    staleness_auto: bool = False  # set by max_staleness=auto; max_staleness then holds the ceiling
    staleness_ceiling: int = 8  # auto: the largest bound, and the one the run starts with
    staleness_floor: int = 0  # auto: the smallest bound (0 = synchronous)
    staleness_drift: DriftMeasure = DriftMeasure.preclip  # auto: the measure the law reads
    staleness_drift_target: float = 0.03  # auto: its mean over the window above this lowers the bound
    staleness_raise_below: float = 0.5  # auto: the bound rises while the mean stays below this x target ...
    staleness_hold_steps: int = 10  # ... for this many steps in a row, one version at a time
    staleness_window_steps: int = 5  # auto: the drift is averaged over this many steps

    # issue 42: the objective (Objective above; docs/objective.md) and each one's knobs, defaults
    # as their sources'. auto = the keys before: algo.decoupled picks decoupled or ppo
    objective: Objective = Objective.auto
    icepop_low: float = 0.5  # icepop: keep a token (sample) while w is in [icepop_low, icepop_high]
    icepop_high: float = 5.0  # IcePop's band as cited (0.5, 5); verl's "0.5_2.0", slime's [0, 2]
    icepop_level: MaskLevel = MaskLevel.token
    m2_budget: float = 0.04  # m2po, m2po_areal: the budget on the mean squared log-ratio
    # m2po: the official code's optional bounds on its clip (miniclip_low/high 0.3 / 0.5): ε_low at
    # least this, ε_high at most this; 0 = off, as in its 256-stale script
    m2po_min_eps_low: float = 0.0
    m2po_max_eps_high: float = 0.0
    prime_mask_low: float = 0.2  # prime: masked when A < 0 and π_θ - π_b < -prime_mask_low ...
    prime_mask_high: float = 0.2  # ... or A > 0 and π_θ - π_b > prime_mask_high (probabilities)
    prime_kl_coef: float = 1e-3  # prime: coefficient of (log π_θ/π_b)² on every valid token
    cispo_eps_low: float = 1.0  # cispo: weight >= 1 - eps_low; 1 = no lower bound (verl's example: 10)
    cispo_eps_high: float = 0.2  # cispo: weight <= 1 + eps_high (verl's example: 1.2)
    ess_step: EssStep = EssStep.off  # VCPO-style: lr times f(ESS) each optimiser step, any objective

    def __post_init__(self) -> None:
        self._resolve_auto_staleness()
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

        self._check_objective()

    def _check_objective(self) -> None:
        self.objective = Objective(self.objective)
        self.icepop_level, self.ess_step = MaskLevel(self.icepop_level), EssStep(self.ess_step)
        objective = self.objective
        if objective is not Objective.auto:
            # the objective decides: those on π_p need the proximal policy; the others anchor on
            # π_b, so the backends pass b as p and skip the proximal pass
            self.decoupled = objective.needs_prox
        if self.loss_objective is not Objective.decoupled and self.prox_logp is ProxLogp.loglinear:
            raise ValueError(
                f"algo.prox_logp=loglinear is only implemented for algo.objective=decoupled "
                f"(got {self.loss_objective.value}): leave algo.prox_logp=current"
            )
        if self.loss_objective in (Objective.m2po, Objective.prime, Objective.cispo):
            if self.importance_level is ImportanceLevel.sequence or self.dual_clip_c > 0:
                raise ValueError(
                    f"algo.objective={objective.value} has its own per-token ratio and clip: leave "
                    "algo.importance_level=token and algo.dual_clip_c=0 (they apply to the PPO clip of "
                    "ppo, decoupled, icepop and m2po_areal)"
                )
        if not 0.0 <= self.icepop_low < 1.0 < self.icepop_high:
            raise ValueError("algo.icepop_low and algo.icepop_high need 0 <= icepop_low < 1 < icepop_high")
        if self.m2_budget <= 0:
            raise ValueError("algo.m2_budget must be > 0 (M2PO's default 0.04)")
        if not 0.0 <= self.m2po_min_eps_low < 1.0 or self.m2po_max_eps_high < 0:
            raise ValueError(
                "algo.m2po_min_eps_low must be in [0, 1) and algo.m2po_max_eps_high >= 0 (0 = off)"
            )
        if self.prime_mask_low <= 0 or self.prime_mask_high <= 0 or self.prime_kl_coef < 0:
            raise ValueError(
                "algo.prime_mask_low/high must be > 0 (probabilities, 0.2) and algo.prime_kl_coef >= 0"
            )
        if self.cispo_eps_low <= 0 or self.cispo_eps_high <= 0:
            raise ValueError("algo.cispo_eps_low and algo.cispo_eps_high must be > 0 (1 and 0.2 by default)")

    @property
    def loss_objective(self) -> Objective:
        """The objective in force: algo.objective, or for auto the one algo.decoupled names."""
        if self.objective is not Objective.auto:
            return self.objective
        return Objective.decoupled if self.decoupled else Objective.ppo

    @property
    def clip_high(self) -> float:
        return self.eps_clip_high or self.clip_eps

    def _resolve_auto_staleness(self) -> None:
        """max_staleness: an int >= 0, or "auto" -> staleness_auto and the ceiling as the hard bound
        (what the trainer's freshness check and every planner read). Idempotent: a saved config
        (max_staleness = the ceiling, staleness_auto true) loads as the same auto run."""
        value = self.max_staleness
        if isinstance(value, str) and value.strip().lower() == "auto":
            self.staleness_auto, value = True, self.staleness_ceiling
        elif isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"algo.max_staleness={value!r}: an integer >= 0 (0 = synchronous) or auto, "
                "e.g. algo.max_staleness=4 or algo.max_staleness=auto"
            )
        self.max_staleness = value
        self.staleness_drift = DriftMeasure(self.staleness_drift)
        if not self.staleness_auto:
            return
        if self.max_staleness != self.staleness_ceiling:
            raise ValueError(
                f"algo.staleness_auto=true takes its ceiling from algo.staleness_ceiling="
                f"{self.staleness_ceiling}, but algo.max_staleness={self.max_staleness}: set "
                "algo.max_staleness=auto (and algo.staleness_ceiling=N for another ceiling)"
            )
        if not 0 <= self.staleness_floor < self.staleness_ceiling:
            raise ValueError(
                f"algo.staleness_floor={self.staleness_floor} and algo.staleness_ceiling="
                f"{self.staleness_ceiling}: need 0 <= floor < ceiling (e.g. algo.staleness_ceiling=8)"
            )
        if self.exact_delay >= 0:
            raise ValueError(
                "algo.exact_delay fixes every sample's staleness; algo.max_staleness=auto moves the "
                "bound: set algo.exact_delay=-1 or a number for algo.max_staleness"
            )
        if not self.staleness_drift_target > 0:
            raise ValueError("algo.staleness_drift_target must be > 0, e.g. algo.staleness_drift_target=0.03")
        if not 0 < self.staleness_raise_below < 1:
            raise ValueError(
                "algo.staleness_raise_below must be in (0, 1), e.g. algo.staleness_raise_below=0.5"
            )
        if self.staleness_hold_steps < 1 or self.staleness_window_steps < 1:
            raise ValueError("algo.staleness_hold_steps and algo.staleness_window_steps must be >= 1")
