"""Allocation planner: which share of the nodes should roll out? The paper fixes 75%; we simulate.

    python -m launch.plan_allocation                                  # paper_1p5b profile, 64 nodes
    python -m launch.plan_allocation --profile trainer_heavy_7b cluster.nodes=32
    python -m launch.submit experiment=math_qwen2_1p5b cluster.rollout_fraction=auto
    python -m launch.plan_allocation --gpus 8,16,32 --profile paper_1p5b   # small clusters: split,
                                            # eta, batch, async/sync gain (launch/planning/layout/small_clusters.py)

For each candidate split (whole nodes), the asynchronous schedule of launch/planning/sim runs on the
profile and the split with the highest trained tokens/s wins. The 75% split is always a candidate
and wins ties, so the choice never loses to it in the simulator. Search: a coarse grid of
sixteenths, then single-node steps uphill from the best one.

With `cluster.rollout_fraction=auto`, launch.submit calls `resolve_auto_fraction(job)`: the profile
`cluster.allocation_profile` supplies the hardware speeds and the length distribution, the job
supplies the cluster size and algo/rollout settings, and only layouts launch.planning.layout.plan accepts
and whose trainer rank fits its GPU (launch/planning/fit/memory_plan.py) compete.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from areal_jobs.config import JobConfig
from launch.planning.fit.memory_plan import check_memory
from launch.planning.layout.plan import apply_plan, plan_job
from launch.planning.sim.engine import SimResult, run_async
from launch.planning.sim.profile import SimProfile, load_profile

logger = logging.getLogger(__name__)

BASELINE_FRACTION = 0.75
COARSE_STEPS = 16
# Expired groups are regenerated, so nothing is lost, but the ones that expire are the long answers:
# a split that expires many trains on a length-biased sample. Splits expiring more than this share
# of the groups they train (or more than the 75% split does) do not compete.
MAX_EXPIRED_SHARE = 0.01


@dataclass(frozen=True)
class Candidate:
    rollout_nodes: int
    fraction: float
    result: SimResult

    @property
    def expired_share(self) -> float:
        return self.result.expired_groups / max(1, self.result.extra["trained_groups"])

    @property
    def bottleneck(self) -> str:
        # the trainer waiting for batches means generation cannot keep up, and vice versa
        return "rollout" if self.result.gen_s > 0.05 * self.result.step_s else "trainer"


@dataclass(frozen=True)
class AllocationChoice:
    best: Candidate
    baseline: Candidate | None  # None when the 75% split is not a valid layout
    candidates: tuple[Candidate, ...]  # every split simulated, by rollout nodes

    @property
    def gain_over_baseline(self) -> float:
        return (
            self.best.result.tokens_per_s / self.baseline.result.tokens_per_s
            if self.baseline
            else float("nan")
        )

    def explain(self, nodes: int) -> str:
        b = self.best
        lines = [
            "| rollout nodes | fraction | trained tok/s | step s | bottleneck | rollout busy | expired groups (share) |",
            "|---:|---:|---:|---:|---|---:|---:|",
        ]
        for c in self.candidates:
            mark = " **chosen**" if c is b else (" (75%)" if c is self.baseline else "")
            r = c.result
            lines.append(
                f"| {c.rollout_nodes}{mark} | {c.fraction:.4f} | {r.tokens_per_s:,.0f} | {r.step_s:.1f} | {c.bottleneck} "
                f"| {r.rollout_busy:.2f} | {r.expired_groups} ({c.expired_share:.1%}) |"
            )
        why = (
            f"chose rollout_fraction={b.fraction:.4f} ({b.rollout_nodes} of {nodes} nodes): "
            f"{b.result.tokens_per_s:,.0f} trained tokens/s, {b.bottleneck}-bound."
        )
        if self.baseline is not None and self.baseline is not b:
            base = self.baseline
            why += (
                f" The paper's 75% ({base.rollout_nodes} nodes) gives {base.result.tokens_per_s:,.0f} "
                f"and is {base.bottleneck}-bound"
                + (
                    ", so nodes move to the trainer"
                    if b.rollout_nodes < base.rollout_nodes
                    else ", so nodes move to rollout"
                )
                + f": the chosen split is {self.gain_over_baseline:.2f}x faster."
            )
        elif self.baseline is b:
            why += " The paper's 75% split is already the best (ties go to it)."
        why += (
            f" Splits that expire more than {MAX_EXPIRED_SHARE:.0%} of their groups (long answers past eta, "
            "regenerated: a length-biased sample) do not compete."
        )
        return "\n".join(lines) + "\n\n" + why


def choose_rollout_fraction(
    profile: SimProfile, valid: Callable[[int], bool] = lambda rollout_nodes: True
) -> AllocationChoice:
    """Best split of `profile.cluster.nodes` for the asynchronous schedule. Pure (simulation only)."""
    nodes = profile.cluster.nodes
    allowed = [r for r in range(1, nodes) if valid(r)]
    if not allowed:
        raise ValueError(f"no split of cluster.nodes={nodes} gives a valid layout: raise cluster.nodes")
    results: dict[int, Candidate] = {}

    def simulate(r: int) -> Candidate:
        if r not in results:
            q = copy.deepcopy(profile)
            q.cluster.rollout_fraction = r / nodes
            results[r] = Candidate(r, r / nodes, run_async(q))
        return results[r]

    base_nodes = _nodes_of(nodes, BASELINE_FRACTION)
    coarse = {_nodes_of(nodes, i / COARSE_STEPS) for i in range(1, COARSE_STEPS)} | {base_nodes}
    for r in sorted(coarse):
        if r in allowed:
            simulate(r)

    def score(c: Candidate) -> tuple[bool, float, bool]:
        limit = max(MAX_EXPIRED_SHARE, results[base_nodes].expired_share if base_nodes in results else 0.0)
        return (c.expired_share <= limit, c.result.tokens_per_s, c.rollout_nodes == base_nodes)

    best = max(results.values(), key=score)
    while True:  # hill-climb one node at a time among valid splits
        i = allowed.index(best.rollout_nodes)
        neighbours = [simulate(allowed[j]) for j in (i - 1, i + 1) if 0 <= j < len(allowed)]
        step = max([best, *neighbours], key=score)
        if step is best:
            break
        best = step
    ordered = tuple(results[r] for r in sorted(results))
    return AllocationChoice(best=best, baseline=results.get(base_nodes), candidates=ordered)


def _nodes_of(nodes: int, fraction: float) -> int:
    return min(nodes - 1, max(1, int(nodes * fraction + 1e-9)))


def profile_for_job(job: JobConfig, profile_name: str) -> SimProfile:
    """The named profile's speeds and lengths, with the job's cluster size and algo/rollout settings."""
    p = load_profile(profile_name)
    p.cluster.nodes = job.cluster.nodes
    p.cluster.gpus_per_node = job.cluster.gpus_per_node
    p.cluster.rollout_tp = job.rollout.tp_size
    p.algo.batch_size = job.algo.batch_size
    p.algo.group_size = job.algo.group_size
    p.algo.max_staleness = job.algo.max_staleness
    p.algo.max_concurrent = job.rollout.max_concurrent
    p.lengths.max_tokens = job.rollout.max_new_tokens
    p.lengths.median_tokens = min(p.lengths.median_tokens, p.lengths.max_tokens)
    p.__post_init__()  # re-validate with the job's values
    return p


def resolve_rollout_fraction(job: JobConfig) -> tuple[float, AllocationChoice]:
    """The fraction for `cluster.rollout_fraction=auto`, among layouts launch.planning.layout.plan accepts."""

    def valid(rollout_nodes: int) -> bool:
        """The planner accepts the layout and a trainer rank fits its GPU (fewer trainer GPUs
        shard the optimizer over fewer ranks: launch/planning/fit/memory_plan.py)."""
        cluster = dataclasses.replace(job.cluster, rollout_fraction=str(rollout_nodes / job.cluster.nodes))
        candidate = dataclasses.replace(job, cluster=cluster)
        try:
            plan = plan_job(candidate)
            check_memory(apply_plan(candidate, plan), plan)
        except ValueError:
            return False
        return True

    choice = choose_rollout_fraction(profile_for_job(job, job.cluster.allocation_profile), valid)
    return choice.best.fraction, choice


def resolve_auto_fraction(job: JobConfig) -> JobConfig:
    """`job` with `cluster.rollout_fraction=auto` replaced by the simulator's choice (logged with
    its reason); any other job unchanged. Call it before launch.planning.layout.plan.plan_job."""
    if not job.cluster.rollout_fraction_auto:
        return job
    fraction, choice = resolve_rollout_fraction(job)
    logger.info("cluster.rollout_fraction=auto: %s", choice.explain(job.cluster.nodes).rsplit("\n", 1)[-1])
    return dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, rollout_fraction=repr(fraction)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launch.plan_allocation", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--profile", default="paper_1p5b", help="conf/sim/<name>.yaml or a YAML path")
    parser.add_argument(
        "--gpus",
        default="",
        help="small clusters: GPU counts (e.g. 8,16,32) to advise split, eta and batch for",
    )
    parser.add_argument("--gpus-per-node", type=int, default=8, help="with --gpus: GPUs per node")
    parser.add_argument(
        "overrides", nargs="*", help="profile overrides, e.g. cluster.nodes=32 algo.max_staleness=8"
    )
    args = parser.parse_args(argv)
    try:
        profile = load_profile(args.profile, args.overrides)
        if args.gpus:
            return _print_guidance(profile, [int(g) for g in args.gpus.split(",")], args.gpus_per_node)
        choice = choose_rollout_fraction(profile)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    c = profile.cluster
    print(
        f"## Rollout fraction for {profile.name}: {c.nodes} nodes x {c.gpus_per_node} GPUs, eta={profile.algo.max_staleness}\n"
    )
    print(choice.explain(c.nodes))
    return 0


def _print_guidance(profile: SimProfile, gpus: list[int], gpus_per_node: int) -> int:
    from launch.planning.layout.small_clusters import advise, guidance_markdown

    rows = [advise(profile, n, choose_rollout_fraction) for n in gpus]
    print(f"## Small-cluster guidance for {profile.name} ({gpus_per_node} GPUs per node)\n")
    print(guidance_markdown(rows, profile.algo.group_size))
    for g in rows:
        nodes = -(-g.gpus // gpus_per_node)
        print(
            f"\n{g.gpus} GPUs: cluster.nodes={nodes} cluster.rollout_fraction={g.rollout_gpus / g.gpus:.6g} "
            f"algo.max_staleness={g.eta} algo.batch_size={g.batch_size}: {g.gain:.2f}x the best synchronous "
            "schedule"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
