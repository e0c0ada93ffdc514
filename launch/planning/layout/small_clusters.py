"""Guidance for small clusters (8-32 GPUs): split, eta, batch and the async/sync gain, simulated.

    python -m launch.plan_allocation --gpus 8 --profile paper_1p5b
    python -m launch.plan_allocation --gpus 8,16,32 --profile paper_1p5b

The simulator of launch/planning/sim (the project's own staleness admission, freshness rule and DP
balancing) runs the profile's hardware and length model on `gpus` GPUs split at GPU granularity
(one unit = one rollout server of `cluster.rollout_tp` GPUs), as cluster.placement=gpus renders it.
Recommendations, in this order (each one a pure function of the simulated throughputs):
  batch  the smallest candidate number of prompts per step whose throughput (75% split, the
         profile's eta) is within 10% of the largest candidate's: more updates per token without
         leaving GPUs idle (small clusters saturate at small batches);
  split  the highest-throughput split (launch.planning.layout.allocation.choose_rollout_fraction); every
         split of whole servers is renderable by launch/planning/layout/placement.py (cluster.placement=gpus);
  eta    the smallest eta in 1, 2, 4, 8 within 2% of the best throughput (fresher data for free);
  gain   async throughput over the better synchronous schedule at the same GPU count: eta = 0 on
         the same split, or colocated (every GPU generates, then every GPU trains).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from launch.planning.sim.engine import SimResult, run_async, run_sync
from launch.planning.sim.profile import SimProfile

# the split search is launch.planning.layout.allocation.choose_rollout_fraction, passed in by its CLI (which
# imports this module); an eta that expires more than this share of its groups does not compete,
# as in that search
MAX_EXPIRED_SHARE = 0.01
Chooser = Callable[[SimProfile, Callable[[int], bool]], Any]

BATCH_CANDIDATES = (32, 64, 128, 256, 512)
ETA_CANDIDATES = (1, 2, 4, 8)
BATCH_TOLERANCE = 0.10
ETA_TOLERANCE = 0.02


@dataclass(frozen=True)
class Guidance:
    gpus: int
    rollout_gpus: int
    trainer_gpus: int
    eta: int
    batch_size: int  # prompts per step (x group_size answers)
    async_: SimResult
    sync: SimResult  # same split, eta = 0
    colocated: SimResult  # every GPU generates, then trains

    @property
    def gain(self) -> float:
        """Async over the better synchronous schedule."""
        return self.async_.tokens_per_s / max(self.sync.tokens_per_s, self.colocated.tokens_per_s)


def gpu_profile(p: SimProfile, gpus: int) -> SimProfile:
    """`p` on `gpus` GPUs, one simulated "node" per rollout server so every split is reachable."""
    tp = p.cluster.rollout_tp
    if gpus % tp or gpus // tp < 2:
        raise ValueError(f"--gpus {gpus}: needs at least two units of cluster.rollout_tp={tp} GPUs")
    q = copy.deepcopy(p)
    q.cluster.gpus_per_node = tp
    q.cluster.nodes = gpus // tp
    q.cluster.check()
    return q


def _with(p: SimProfile, **algo: int) -> SimProfile:
    q = copy.deepcopy(p)
    for key, value in algo.items():
        setattr(q.algo, key, value)
    return q


def advise(profile: SimProfile, gpus: int, choose: Chooser) -> Guidance:
    """`choose`: launch.planning.layout.allocation.choose_rollout_fraction."""
    base = gpu_profile(profile, gpus)
    units, tp = base.cluster.nodes, base.cluster.rollout_tp
    batches = [b for b in BATCH_CANDIDATES if b <= profile.algo.batch_size] or [profile.algo.batch_size]
    by_batch = {b: run_async(_with(base, batch_size=b)).tokens_per_s for b in batches}
    top = max(by_batch.values())
    batch = min(b for b, tps in by_batch.items() if tps >= (1 - BATCH_TOLERANCE) * top)

    sized = _with(base, batch_size=batch)
    choice = choose(sized, lambda rollout_units: True)
    split = copy.deepcopy(sized)
    split.cluster.rollout_fraction = choice.best.rollout_nodes / units

    by_eta: dict[int, SimResult] = {}
    for eta in ETA_CANDIDATES:
        r = run_async(_with(split, max_staleness=eta))
        if r.expired_groups <= MAX_EXPIRED_SHARE * r.extra["trained_groups"]:
            by_eta[eta] = r
    if not by_eta:  # every eta expires groups: keep the profile's
        by_eta[split.algo.max_staleness] = run_async(split)
    best = max(r.tokens_per_s for r in by_eta.values())
    eta = min(e for e, r in by_eta.items() if r.tokens_per_s >= (1 - ETA_TOLERANCE) * best)

    rollout_gpus = choice.best.rollout_nodes * tp
    return Guidance(
        gpus=gpus,
        rollout_gpus=rollout_gpus,
        trainer_gpus=gpus - rollout_gpus,
        eta=eta,
        batch_size=batch,
        async_=by_eta[eta],
        sync=run_sync(_with(split, max_staleness=0)),
        colocated=run_sync(_with(split, max_staleness=0), colocated=True),
    )


def guidance_markdown(rows: list[Guidance], group_size: int) -> str:
    lines = [
        "| GPUs | split rollout + trainer | eta | batch (prompts x answers) | async tok/s | step s "
        "| sync tok/s (same split) | colocated sync tok/s | async / best sync |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for g in rows:
        lines.append(
            f"| {g.gpus} | {g.rollout_gpus} + {g.trainer_gpus} | {g.eta} | {g.batch_size} x {group_size} "
            f"| {g.async_.tokens_per_s:,.0f} | {g.async_.step_s:.0f} | {g.sync.tokens_per_s:,.0f} "
            f"| {g.colocated.tokens_per_s:,.0f} | {g.gain:.2f} |"
        )
    return "\n".join(lines)
