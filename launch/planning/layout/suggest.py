"""When the planner refuses a layout, find the overrides that make one work, by asking the planner.

    math_qwen2_7b at cluster.nodes=5: TP 4 cannot use the 2 trainer GPUs of the shared node
      -> cluster.placement=nodes (3 rollout + 2 trainer nodes) works
    code_qwen2_14b at cluster.nodes=10: 7 + 3 nodes give 24 trainer GPUs, not a multiple of TP 8 x PP 2
      -> cluster.rollout_fraction=0.8 (8 + 2 nodes) works; no placement alone does

Nothing here is hard-coded per experiment: every candidate (another cluster.placement, another
cluster.rollout_fraction, then another cluster.nodes) is planned by launch/planning/layout/plan.py and kept
only when the planner accepts it. The candidates that change the fewest keys come first; among
those, the ones that keep the requested rollout fraction, then the ones whose rollout share of the
GPUs is closest to it. Colocated is never suggested: it changes the schedule (synchronous), not
only the layout. When nothing works the refusal says what was tried and why nothing can (the
planner's reason names the setting that has to change instead, e.g. trainer.tp_size).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from areal_jobs.config import JobConfig, Placement
from launch.planning.layout.placement import LayoutError
from launch.planning.layout.plan import AllocationPlan, plan_job, plural

MAX_SHOWN = 3  # alternatives named in one refusal
# a further test a candidate layout must pass (the memory check's: its trainer rank fits its GPU)
Accept = Callable[[JobConfig, AllocationPlan], bool]


@dataclass(frozen=True)
class LayoutFix:
    """Overrides that turn a refused job into one the planner accepts, and the plan they give."""

    overrides: tuple[str, ...]
    plan: AllocationPlan

    def describe(self) -> str:
        p = self.plan
        if p.placement is Placement.nodes:
            where = f"{p.rollout_nodes} rollout + {plural(p.trainer_nodes, 'trainer node')}"
        else:
            where = f"{p.rollout_gpus} rollout + {plural(p.trainer_gpus, 'trainer GPU')}, {p.placement.value} placement"
        return f"{' '.join(self.overrides)} ({where}; trainer {p.trainer_layout})"


def plan_or_explain(job: JobConfig) -> AllocationPlan:
    """plan_job, or a LayoutError that also names the overrides that make the layout work (or says
    that none of them does, and why)."""
    try:
        return plan_job(job)
    except LayoutError as err:
        raise LayoutError(f"{err}. {explain_fixes(job)}") from None


def explain_fixes(job: JobConfig) -> str:
    fixes = layout_fixes(job)
    c = job.cluster
    if fixes:
        shown = "; ".join(f.describe() for f in fixes)
        at = "" if any(o.startswith("cluster.nodes=") for o in fixes[0].overrides) else f" at {c.nodes} nodes"
        return (
            f"Layouts that work{at}, best first: {shown}"
            if len(fixes) > 1
            else f"A layout that works{at}: {shown}"
        )
    return (
        f"No layout works: no other cluster.placement or cluster.rollout_fraction at cluster.nodes={c.nodes}, "
        f"nor any cluster.nodes from 1 to {2 * c.nodes} with a split of whole nodes; the constraint above "
        "does not depend on the split, so change the setting it names"
    )


def layout_fixes(job: JobConfig, limit: int = MAX_SHOWN, accept: Accept | None = None) -> list[LayoutFix]:
    """Up to `limit` fixes: at the requested node count when any works, else the nearest node
    counts. `accept`: a further test of each planned candidate (launch/planning/fit/memory_plan.py's
    fitting_layouts: its trainer rank fits its GPU)."""
    same = sorted(_fixes_at(job, job.cluster.nodes, accept), key=lambda scored: scored[0])
    if same:
        return _distinct([fix for _, fix in same], limit)
    return _distinct(list(_other_node_counts(job, accept)), limit)


def _distinct(fixes: list[LayoutFix], limit: int) -> list[LayoutFix]:
    """Drop a fix whose split an earlier one already gives (auto, nodes and gpus may split alike)."""
    out: list[LayoutFix] = []
    seen = set()
    for fix in fixes:
        p = fix.plan
        key = (p.rollout_nodes, p.shared_rollout_gpus, p.trainer_nodes)
        if key not in seen:
            seen.add(key)
            out.append(fix)
        if len(out) == limit:
            break
    return out


def _try(job: JobConfig, accept: Accept | None = None, **cluster_changes: object) -> AllocationPlan | None:
    try:
        cluster = dataclasses.replace(job.cluster, **cluster_changes)
        candidate = dataclasses.replace(job, cluster=cluster)
        plan = plan_job(candidate)
        return plan if accept is None or accept(candidate, plan) else None
    except ValueError:  # LayoutError, or a value the cluster config itself refuses
        return None


def _placements(job: JobConfig) -> list[Placement]:
    """The user's placement first, then the other layouts that keep the asynchronous schedule."""
    others = [p for p in (Placement.auto, Placement.nodes, Placement.gpus) if p is not job.cluster.placement]
    return [job.cluster.placement, *others]


def _fractions(job: JobConfig, nodes: int) -> Iterator[str]:
    """Every distinct split of whole nodes and of whole GPUs, each as its shortest decimal."""
    gpus = nodes * job.cluster.gpus_per_node
    for parts in sorted({nodes, gpus}):
        for k in range(1, parts):
            yield _short_fraction(k, parts)


def _short_fraction(k: int, parts: int) -> str:
    """The shortest decimal d with floor(parts * d) = k (what placement.py computes back): 1 of 3
    is 0.34, 6 of 8 is 0.75."""
    for digits in range(1, 8):
        d = math.ceil(k / parts * 10**digits - 1e-9) / 10**digits
        if 0 < d < 1 and math.floor(parts * d + 1e-9) == k:
            return repr(d)
    return repr(k / parts)


def _fixes_at(job: JobConfig, nodes: int, accept: Accept | None = None) -> Iterator[tuple[tuple, LayoutFix]]:
    c = job.cluster
    requested = c.rollout_share
    for rank, placement in enumerate(_placements(job)):
        for fraction in [c.rollout_fraction, *_fractions(job, nodes)]:
            if placement is c.placement and fraction == c.rollout_fraction:
                continue  # the refused layout itself
            plan = _try(job, accept, placement=placement, rollout_fraction=fraction, nodes=nodes)
            if plan is None:
                continue
            overrides = []
            if placement is not c.placement:
                overrides.append(f"cluster.placement={placement.value}")
            if fraction != c.rollout_fraction:
                overrides.append(f"cluster.rollout_fraction={fraction}")
            share = plan.rollout_gpus / (plan.nodes * plan.gpus_per_node)
            score = (len(overrides), fraction != c.rollout_fraction, round(abs(share - requested), 9), rank)
            yield score, LayoutFix(tuple(overrides), plan)


def _other_node_counts(job: JobConfig, accept: Accept | None = None) -> Iterator[LayoutFix]:
    """Fixes at the nearest node count where any works (smaller first on a tie): the requested
    placement and fraction, another placement, or a split of whole nodes (GPU-level fractions are
    searched at the requested count only, which keeps a hopeless 64-node job to seconds)."""
    c = job.cluster
    for nodes in sorted(range(1, 2 * c.nodes + 1), key=lambda n: (abs(n - c.nodes), n)):
        if nodes == c.nodes:
            continue
        found = []
        for rank, placement in enumerate(_placements(job)):
            for fraction in [c.rollout_fraction, *(_short_fraction(k, nodes) for k in range(1, nodes))]:
                plan = _try(job, accept, placement=placement, rollout_fraction=fraction, nodes=nodes)
                if plan is None:
                    continue
                overrides = [f"cluster.nodes={nodes}"]
                if placement is not c.placement:
                    overrides.append(f"cluster.placement={placement.value}")
                if fraction != c.rollout_fraction:
                    overrides.append(f"cluster.rollout_fraction={fraction}")
                share = plan.rollout_gpus / (plan.nodes * plan.gpus_per_node)
                score = (len(overrides), round(abs(share - c.rollout_share), 9), rank)
                found.append((score, LayoutFix(tuple(overrides), plan)))
        if found:
            yield from (fix for _, fix in sorted(found, key=lambda scored: scored[0]))
            return
