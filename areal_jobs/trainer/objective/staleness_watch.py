"""A warning when stale data starts to matter: the pre-clipped share over the last few steps.

`offpolicy/preclip_fraction` (trainer/objective/loss_stats.py) is the share of a step's tokens whose stale
weight w = π_pre / π_behav is already outside the clip range before the step: the only tokens on
which naive and decoupled PPO differ, and the quantity that tracks how far the policy moves while
samples wait (docs/objective.md, "How much staleness can I allow?"). In our runs it sat at
0.5-0.7% where countdown learned (lr 3e-4, η 4) and at 10% where it collapsed (lr 1e-3, the same
η). In `make ablate`'s runs (exact delays 2-32, 4 minibatches) it passed 10% in 18 of the 20
stale decoupled runs, and every decoupled run with a naive pair ended below it (by 0.32 held-out
accuracy on average at delay 8); under naive PPO on the same data it passed 10% in 3 of 15 runs
(lr 3e-4, delay 8, where naive PPO held its start but no more) (bench/README.md, "Where staleness
bites").
`run.preclip_warn_fraction` (default 0.10) is where the trainer says so in its log. The mean over
`window_steps` steps keeps one noisy batch quiet; after a warning the watch stays
silent until the mean falls below half the threshold, so a run that lives above it warns once
per excursion, not every step. Pure logic: the trainer loop feeds it each step's metrics.
"""

from __future__ import annotations

import math
from collections import deque

PRECLIP_KEY = "offpolicy/preclip_fraction"


class PreclipWatch:
    def __init__(self, threshold: float, window_steps: int = 5, objective: str = "ppo") -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        self.threshold = threshold
        self.objective = objective  # the loss in force (AlgoConfig.loss_objective): what to advise
        self.recent: deque[float] = deque(maxlen=window_steps)
        self.armed = True

    def update(self, step: int, metrics: dict[str, float]) -> str | None:
        """The warning to log at this step, or None."""
        value = metrics.get(PRECLIP_KEY)
        if value is None or not math.isfinite(value):
            return None  # not measured this step (naive PPO's later minibatches): nothing to add
        self.recent.append(float(value))
        if len(self.recent) < self.recent.maxlen:
            return None
        mean = sum(self.recent) / len(self.recent)
        if not self.armed:
            self.armed = mean < self.threshold / 2
            return None
        if mean <= self.threshold:
            return None
        self.armed = False
        tail = ", ".join(
            f"{label} {metrics[key]:.3g}"
            for label, key in (("|log w| p99", "offpolicy/abs_log_w_p99"), ("ESS", "offpolicy/ess"))
            if key in metrics
        )
        if self.objective == "ppo":
            advice = (
                "Lower algo.max_staleness, then trainer.lr (the objective is already naive PPO, the one "
                "that held at delay 8 in countdown's staleness ablation)"
            )
        else:
            advice = (
                f"Lower algo.max_staleness, then trainer.lr, and leave algo.objective={self.objective} for "
                "the default naive PPO (algo.objective=ppo, clipped around the behaviour policy): at delay "
                "8 every other objective measured ended below it, the decoupled one in 11 of 11 seed "
                "pairs, issue 42's off-policy ones in 18 of 18"
            )
        return (
            f"step {step}: {mean:.1%} of the tokens trained were already outside the clip range before "
            f"their step (offpolicy/preclip_fraction, mean of the last {len(self.recent)} steps"
            + (f"; {tail}" if tail else "")
            + "): the policy moves far while samples wait, and the objectives now differ. "
            + advice
            + " (docs/objective.md, 'How much staleness can I allow?'); run.preclip_warn_fraction=0 "
            "turns this warning off"
        )
