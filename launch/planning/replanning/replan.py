"""Online re-planning, the pure part: the allocation planner run on what the run measures.

`replan(base, measurement)` takes the measured decode throughput of a rollout GPU (at the batch it
ran), the measured training throughput of a trainer GPU and the answer lengths of recent groups,
puts them into the simulator profile `base` (which keeps the cluster and algo shape), runs
launch.plan_allocation's search and returns the recommended rollout fraction with its expected gain
over the current split: the metrics `plan/recommended_rollout_fraction` and `plan/expected_gain`.

`growth_comparison` shows what that buys on a run whose answers grow: a split planned at the start
and kept, against one re-planned every window from the previous window's profile (the lag a
measuring controller has), each change of split charged `resplit_cost_s` (checkpoint and restart
with the new layout). Longer answers are modelled by `grown_profile` from the profile's own decode
curve. This lives in launch/ because the planner does (the controller, a layer down, cannot import
it; see docs/faults.md).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np

from areal_jobs.data.answer_lengths import LengthStats
from launch.planning.layout.allocation import choose_rollout_fraction
from launch.planning.sim.engine import SimResult, run_async
from launch.planning.sim.profile import LengthModel, SimProfile


@dataclass(frozen=True)
class Measurement:
    """What the controller and the trainer measured over the last window of steps. The answer
    lengths come as groups (`answer_lengths`) or as their statistics (`length_stats`: what the
    metrics stream carries, launch/run/replanner.py); weight sync and prompt length replace the
    profile's when measured."""

    rollout_fraction: float  # the split the run has now
    gen_tokens_per_s_per_gpu: float  # decode tokens/s of one rollout GPU
    gen_batch_per_gpu: float  # mean concurrent sequences per rollout GPU while it was measured
    train_tokens_per_s_per_gpu: float  # prompt + output tokens/s of one trainer GPU
    answer_lengths: tuple[tuple[int, ...], ...] = ()  # output tokens of each answer, one tuple per prompt
    length_stats: LengthStats | None = None  # instead of answer_lengths
    weight_sync_s: float | None = None  # measured pause + broadcast + reload per step
    prompt_tokens: float | None = None  # measured mean prompt length

    def __post_init__(self) -> None:
        if min(self.gen_tokens_per_s_per_gpu, self.gen_batch_per_gpu, self.train_tokens_per_s_per_gpu) <= 0:
            raise ValueError("measured throughputs and batch must be > 0 (measure at least one step)")
        if self.length_stats is None and (
            not self.answer_lengths or any(len(g) == 0 for g in self.answer_lengths)
        ):
            raise ValueError("answer_lengths needs at least one non-empty group (or give length_stats)")

    @property
    def lengths(self) -> LengthStats:
        return self.length_stats or LengthStats.of_groups(self.answer_lengths)


@dataclass(frozen=True)
class Recommendation:
    current_fraction: float
    rollout_fraction: float
    tokens_per_s_current: float
    tokens_per_s_best: float

    @property
    def expected_gain(self) -> float:
        return self.tokens_per_s_best / self.tokens_per_s_current

    def metrics(self) -> dict[str, float]:
        return {
            "plan/recommended_rollout_fraction": self.rollout_fraction,
            "plan/expected_gain": self.expected_gain,
        }


def fit_lengths(groups: tuple[tuple[int, ...], ...], base: LengthModel) -> LengthModel:
    """The profile's lognormal length model fitted to measured groups (fit_length_stats)."""
    return fit_length_stats(LengthStats.of_groups(groups), base)


def fit_length_stats(stats: LengthStats, base: LengthModel) -> LengthModel:
    """Median from the mean log, sample_sigma from the pooled spread inside groups, prompt_sigma
    from the spread of group means less what the sample spread puts there (var / G). Clip bounds
    stay the base's."""
    return LengthModel(
        median_tokens=min(max(math.exp(stats.log_mean), base.min_tokens), base.max_tokens),
        prompt_sigma=math.sqrt(stats.prompt_var),
        sample_sigma=math.sqrt(stats.log_var_within),
        min_tokens=base.min_tokens,
        max_tokens=base.max_tokens,
        prompt_tokens=base.prompt_tokens,
    )


def measured_profile(base: SimProfile, m: Measurement) -> SimProfile:
    """`base` with the measured speeds and lengths. The decode curve keeps its shape and is scaled
    to pass through the measured point (one point cannot tell the shape)."""
    p = copy.deepcopy(base)
    scale = m.gen_tokens_per_s_per_gpu / base.rollout.gpu_tokens_per_s(m.gen_batch_per_gpu)
    p.rollout.tokens_per_s = [v * scale for v in base.rollout.tokens_per_s]
    p.trainer.tokens_per_s_per_gpu = m.train_tokens_per_s_per_gpu
    p.lengths = fit_length_stats(m.lengths, base.lengths)
    if m.prompt_tokens is not None:
        p.lengths.prompt_tokens = max(1, round(m.prompt_tokens))
    if m.weight_sync_s is not None:
        p.trainer.weight_sync_s = m.weight_sync_s
    p.cluster.rollout_fraction = m.rollout_fraction
    p.__post_init__()
    return p


def recommend(profile: SimProfile) -> Recommendation:
    """The planner's split for `profile` against its current `cluster.rollout_fraction`."""
    choice = choose_rollout_fraction(profile)
    nodes = profile.cluster.nodes
    current_nodes = math.floor(nodes * profile.cluster.rollout_fraction + 1e-9)
    current = next((c.result for c in choice.candidates if c.rollout_nodes == current_nodes), None)
    current = current or run_async(profile)
    best = choice.best.result
    if best.tokens_per_s <= current.tokens_per_s:  # the current split stays: no gain to chase
        return Recommendation(
            current_nodes / nodes, current_nodes / nodes, current.tokens_per_s, current.tokens_per_s
        )
    return Recommendation(
        current_nodes / nodes, choice.best.fraction, current.tokens_per_s, best.tokens_per_s
    )


def replan(base: SimProfile, m: Measurement) -> Recommendation:
    return recommend(measured_profile(base, m))


# ---------------------------------------------------------------------------- growing answers


def decode_model(base: SimProfile) -> tuple[float, float]:
    """(a, k) of f(b) = b / (a + k b), least squares on b / f(b): a the per-step cost, k the per-sequence
    cost (KV reads), which grows with the context. The profiles are written in this form."""
    b = np.asarray(base.rollout.batch_sizes, dtype=float)
    y = b / np.asarray(base.rollout.tokens_per_s, dtype=float)
    k, a = np.polyfit(b, y, 1)
    return float(a), float(k)


def grown_profile(base: SimProfile, factor: float, attention_share: float = 0.5) -> SimProfile:
    """`base` with answers `factor` times longer: the median scales (the cap max_tokens stays), each
    sequence's KV reads per decode step scale (k * factor), the KV cache holds 1/factor as many
    sequences, and the attention share of the training cost scales (0.5: the paper profile's
    estimate, as much attention as dense FLOPs at ~8k-token contexts)."""
    if factor <= 0 or not 0.0 <= attention_share <= 1.0:
        raise ValueError("growth: length factors must be > 0 and attention_share in [0, 1]")
    a, k = decode_model(base)
    p = copy.deepcopy(base)
    p.lengths.median_tokens = min(base.lengths.median_tokens * factor, base.lengths.max_tokens)
    p.rollout.tokens_per_s = [b / (a + k * factor * b) for b in base.rollout.batch_sizes]
    p.rollout.max_batch_per_gpu = max(1, int(base.rollout.max_batch_per_gpu / factor))
    p.trainer.tokens_per_s_per_gpu = base.trainer.tokens_per_s_per_gpu / (
        1 - attention_share + attention_share * factor
    )
    p.__post_init__()
    return p


@dataclass(frozen=True)
class GrowthWindow:
    factor: float
    static_fraction: float
    replanned_fraction: float
    static: SimResult
    replanned: SimResult


@dataclass(frozen=True)
class GrowthReport:
    windows: tuple[GrowthWindow, ...]
    steps_per_window: int
    resplit_cost_s: float

    @property
    def changes(self) -> int:
        fr = [w.replanned_fraction for w in self.windows]
        return sum(1 for x, y in zip(fr, fr[1:], strict=False) if x != y)

    def _time_s(self, attr: str) -> float:
        return sum(getattr(w, attr).step_s * self.steps_per_window for w in self.windows)

    @property
    def static_s(self) -> float:
        return self._time_s("static")

    @property
    def replanned_s(self) -> float:
        return self._time_s("replanned") + self.changes * self.resplit_cost_s

    @property
    def gain(self) -> float:
        """Wall time of the static run over the re-planned one, for the same steps."""
        return self.static_s / self.replanned_s


def growth_comparison(
    base: SimProfile,
    factors: tuple[float, ...],
    steps_per_window: int,
    resplit_cost_s: float,
    min_gain: float = 1.0,
    attention_share: float = 0.5,
) -> GrowthReport:
    """Window i runs with answers factors[i] times the base's. Static: planned on window 0, kept.
    Re-planned: from window 2 on, `recommend` runs on window i-1's profile (what the controller has
    measured by then) at the split in use, and the split changes when the expected gain reaches
    `min_gain`; windows 0 and 1 run the start's plan."""
    if len(factors) < 2 or steps_per_window < 1 or resplit_cost_s < 0 or min_gain < 1.0:
        raise ValueError(
            "growth: need >= 2 length factors, steps_per_window >= 1, resplit_cost_s >= 0, min_gain >= 1"
        )
    profiles = [grown_profile(base, f, attention_share) for f in factors]
    start = choose_rollout_fraction(profiles[0]).best.fraction
    fractions = [start, start]
    for measured in profiles[1:-1]:
        measured.cluster.rollout_fraction = fractions[-1]
        rec = recommend(measured)
        fractions.append(rec.rollout_fraction if rec.expected_gain >= min_gain else fractions[-1])
    runs: dict[tuple[int, float], SimResult] = {}

    def run(i: int, fraction: float) -> SimResult:
        if (i, fraction) not in runs:
            runs[i, fraction] = run_async(profiles[i], fraction)
        return runs[i, fraction]

    windows = [
        GrowthWindow(f, start, fractions[i], run(i, start), run(i, fractions[i]))
        for i, f in enumerate(factors)
    ]
    return GrowthReport(tuple(windows), steps_per_window, resplit_cost_s)
