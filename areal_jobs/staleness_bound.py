"""algo.max_staleness=auto: the admission bound eta follows the drift the trainer measures.

Per trainer step the controller gets the step's drift d (default: `offpolicy/preclip_fraction`,
the share of tokens whose stale weight w = π_pre / π_behav is outside the clip range before the
step; trainer/objective/loss_stats.py) and the mean staleness of its batch. With s = the mean of the last W
drifts and ℓ = the mean of the last W batch staleness values:

    cut    s > T                         eta <- clamp(floor(min(eta, ℓ) * T / s), floor, eta - 1)
    raise  s < ρ T for H steps in a row  eta <- min(eta + 1, ceiling)
    after a change from a to b nothing moves for max(a, b) + W steps (the dead time)

Why each part:
- The cut is proportional: the drift grows about linearly with the lag in our measurements
  (docs/objective.md: 3.7% at exact delay 2, 4.3-9.8% at 8 under naive PPO), so the lag that brings
  d back to T is ℓ T / s. ℓ rather than eta because a bound the generation does not reach (it is
  slower than the trainer) binds nothing: cutting from it would take several rounds.
- The dead time: a group admitted under eta is trained eta versions later (generation running
  ahead fills every slot at once), so a change shows in the trained batches only after
  max(a, b) versions, and in the window mean W steps later. Deciding sooner would cut again on
  data from the old bound (windup) or raise twice before the first raise is seen.
- Hysteresis: the raise threshold ρ T sits below the cut threshold T; with a linear drift one
  step of eta changes d by at most a factor 2 above eta = 1, so ρ = 0.5 leaves no bound where a
  raise is cut back at once. The one place it can happen (eta 0 -> 1 when lag 1 already exceeds
  T) is caught by the back-off: a cut that follows a raise doubles H for the next raise (up to
  MAX_BACKOFF x), so a failed raise is retried ever more rarely.
- W steps of measurements before the first decision: one noisy batch decides nothing.
Already-admitted groups keep the bound they were admitted with (the trainer's freshness check
stays at the ceiling, algo.max_staleness): nothing generated is thrown away when eta falls, and
the backlog drains within the dead time (docs/objective.md, "How much staleness can I allow?").

Pure: no clocks, no I/O; the controller calls `update` once per trainer version.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from areal_jobs.config.algo import AlgoConfig, DriftMeasure

MAX_BACKOFF = 16  # a raise cut back at once waits at most this many times H before the next try


@dataclass(frozen=True)
class BoundParams:
    ceiling: int  # the largest bound (algo.staleness_ceiling); the start value
    target: float = 0.03  # T: the window mean of the drift above this lowers the bound
    raise_below: float = 0.5  # ρ: raise only while the mean stays below ρ T ...
    hold_steps: int = 10  # H: ... for this many steps in a row
    window_steps: int = 5  # W: the drift is averaged over this many steps
    floor: int = 0  # the smallest bound (0 = synchronous)

    def __post_init__(self) -> None:
        if not 0 <= self.floor < self.ceiling:
            raise ValueError(f"need 0 <= floor < ceiling, got floor {self.floor}, ceiling {self.ceiling}")
        if self.target <= 0 or not 0 < self.raise_below < 1:
            raise ValueError("need target > 0 and 0 < raise_below < 1")
        if self.hold_steps < 1 or self.window_steps < 1:
            raise ValueError("need hold_steps >= 1 and window_steps >= 1")


class StalenessBoundLaw:
    """The control law's state and its per-step update (module docstring)."""

    def __init__(self, params: BoundParams) -> None:
        self.p = params
        self.bound = params.ceiling
        self.drifts: deque[float] = deque(maxlen=params.window_steps)
        self.lags: deque[float] = deque(maxlen=params.window_steps)
        self.calm_steps = 0  # steps in a row with the mean below ρ T
        self.frozen_steps = 0  # dead time left after the last change
        self.backoff = 1  # H is multiplied by this (doubled when a raise is cut back)
        self.last_change = 0  # +1 raise, -1 cut, 0 none yet
        self.changes = 0

    @property
    def smoothed(self) -> float | None:
        """The window mean of the drift (None before the first measurement)."""
        return sum(self.drifts) / len(self.drifts) if self.drifts else None

    def update(self, drift: float | None, lag: float | None = None) -> int:
        """One trainer version: `drift` its measure (None or NaN: not measured, the dead time still
        runs), `lag` its batch's mean staleness (None: the bound stands in). Returns the bound."""
        if self.frozen_steps > 0:
            self.frozen_steps -= 1
        if drift is None or not math.isfinite(drift):
            return self.bound
        self.drifts.append(float(drift))
        if lag is not None and math.isfinite(lag):
            self.lags.append(float(lag))
        s = self.smoothed
        assert s is not None
        self.calm_steps = self.calm_steps + 1 if s < self.p.raise_below * self.p.target else 0
        if self.frozen_steps > 0 or len(self.drifts) < self.p.window_steps:
            return self.bound
        if s > self.p.target and self.bound > self.p.floor:
            base = min(float(self.bound), sum(self.lags) / len(self.lags)) if self.lags else self.bound
            cut = math.floor(base * self.p.target / s)
            if self.last_change > 0:  # the last raise overshot: try the next one later
                self.backoff = min(2 * self.backoff, MAX_BACKOFF)
            self._change(min(max(cut, self.p.floor), self.bound - 1), -1)
        elif self.calm_steps >= self.p.hold_steps * self.backoff and self.bound < self.p.ceiling:
            if self.last_change > 0:  # the raise before held: retry at the normal rate
                self.backoff = 1
            self._change(self.bound + 1, +1)
        return self.bound

    def _change(self, new: int, direction: int) -> None:
        self.frozen_steps = max(self.bound, new) + self.p.window_steps
        self.bound = new
        self.calm_steps = 0
        self.last_change = direction
        self.changes += 1

    def state_dict(self) -> dict:
        """For checkpoints (the controller's snapshot)."""
        return {
            "bound": self.bound,
            "drifts": list(self.drifts),
            "lags": list(self.lags),
            "calm_steps": self.calm_steps,
            "frozen_steps": self.frozen_steps,
            "backoff": self.backoff,
            "last_change": self.last_change,
            "changes": self.changes,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore; a bound outside [floor, ceiling] (the ceiling changed on resume) is clamped."""
        self.bound = min(max(int(state["bound"]), self.p.floor), self.p.ceiling)
        self.drifts = deque((float(x) for x in state["drifts"]), maxlen=self.p.window_steps)
        self.lags = deque((float(x) for x in state["lags"]), maxlen=self.p.window_steps)
        for name in ("calm_steps", "frozen_steps", "backoff", "last_change", "changes"):
            setattr(self, name, int(state[name]))


def bound_params(algo: AlgoConfig) -> BoundParams:
    """The law's parameters from algo.staleness_* (algo.max_staleness=auto)."""
    return BoundParams(
        ceiling=algo.staleness_ceiling,
        target=algo.staleness_drift_target,
        raise_below=algo.staleness_raise_below,
        hold_steps=algo.staleness_hold_steps,
        window_steps=algo.staleness_window_steps,
        floor=algo.staleness_floor,
    )


def drift_of(metrics: dict[str, float], measure: DriftMeasure) -> float | None:
    """The step's drift from the trainer's metrics (trainer/objective/loss_stats.py), or None where the
    step measured no token's π_pre (its shares would read 0: not a calm step, no step at all)."""
    if not metrics.get("offpolicy/measured_fraction", 0.0) > 0:
        return None
    key = "offpolicy/preclip_fraction" if measure is DriftMeasure.preclip else "offpolicy/ess"
    value = metrics.get(key)
    if value is None or not math.isfinite(value):
        return None
    return float(value) if measure is DriftMeasure.preclip else 1.0 - float(value)
