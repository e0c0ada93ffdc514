"""Autoscale: how many rollout nodes a running job should have, its trainer held fixed.

The trainer group cannot grow in a running job (a trainer rank more means a restart), the rollout
pool can (launch/run/elastic.py, `make scale`). So the question the re-planner asks for
`cluster.autoscale=true` is not the planner's "which split of N nodes" but "how many rollout nodes
beside these trainer nodes", answered with the simulator on the measured profile:

- **grow** to the fewest rollout nodes, at most `max_nodes`, that raise trained tokens/s by at
  least `min_gain` (generation is the bottleneck);
- else **shrink** towards the pool with the most trained tokens/s per node (rollout + trainer),
  keeping at least 1 / (1 + `min_gain`) of today's trained tokens/s, if that is at least
  `min_gain` better per node than now (the trainer is the bottleneck: rollout nodes stand idle);
- else keep the pool.

A local run counts rollout servers as nodes (one each) and its trainer ranks as trainer nodes.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

from launch.planning.layout.allocation import MAX_EXPIRED_SHARE
from launch.planning.sim.engine import SimResult, run_async
from launch.planning.sim.profile import SimProfile

# growing stops once one more node adds less than this: the trainer has become the bottleneck
_PLATEAU = 1.001


@dataclass(frozen=True)
class ScaleDecision:
    current_nodes: int
    target_nodes: int
    expected_gain: float  # grow: trained tokens/s ratio; shrink: per node; keep: 1
    reason: str

    @property
    def change(self) -> int:
        return self.target_nodes - self.current_nodes

    def metrics(self) -> dict[str, float]:
        return {
            "plan/autoscale_target_nodes": float(self.target_nodes),
            "plan/autoscale_gain": self.expected_gain,
        }


def pool_throughput(profile: SimProfile, trainer_nodes: int, current_nodes: int) -> Callable[[int], float]:
    """r -> simulated trained tokens/s of `profile` with r rollout nodes beside `trainer_nodes`.

    As the planner (launch/planning/layout/allocation.py), a pool that expires more than MAX_EXPIRED_SHARE of
    the groups it trains (or more than the current pool does) counts as 0: its throughput is made
    of the short answers while the long ones expire and are regenerated (a length-biased sample)."""

    @functools.cache
    def run(r: int) -> SimResult:
        q = copy.deepcopy(profile)
        q.cluster.nodes = trainer_nodes + r
        return run_async(q, r / q.cluster.nodes)

    def expired_share(res: SimResult) -> float:
        return res.expired_groups / max(1, res.extra["trained_groups"])

    limit = max(MAX_EXPIRED_SHARE, expired_share(run(current_nodes)))

    def tokens_per_s(r: int) -> float:
        res = run(r)
        return res.tokens_per_s if r == current_nodes or expired_share(res) <= limit else 0.0

    return tokens_per_s


def scale_decision(
    tokens_per_s: Callable[[int], float],
    trainer_nodes: int,
    rollout_nodes: int,
    max_nodes: int,
    min_gain: float,
) -> ScaleDecision:
    """`tokens_per_s(r)`: trained tokens/s with r rollout nodes (pool_throughput in a run; a
    hand-made curve in the tests). Evaluated lazily, each r at most once."""
    if rollout_nodes < 1 or trainer_nodes < 1 or min_gain < 0:
        raise ValueError("autoscale: need >= 1 rollout and trainer node and min_gain >= 0")
    tput = functools.cache(tokens_per_s)
    r0, now = rollout_nodes, tput(rollout_nodes)
    for r in range(r0 + 1, max_nodes + 1):
        gain = tput(r) / now
        if gain > 1 and gain >= 1 + min_gain:
            return ScaleDecision(
                r0,
                r,
                gain,
                f"generation is the bottleneck: {r} rollout nodes give x{gain:.2f} trained tokens/s",
            )
        if tput(r) < _PLATEAU * tput(r - 1):
            break

    def per_node(r: int) -> float:
        return tput(r) / (r + trainer_nodes)

    best = r0  # down while per node improves and the pool keeps >= 1 / (1 + min_gain) of now
    while best > 1 and per_node(best - 1) > per_node(best) and (1 + min_gain) * tput(best - 1) >= now:
        best -= 1
    gain = per_node(best) / per_node(r0)
    if best < r0 and gain >= 1 + min_gain:
        return ScaleDecision(
            r0, best, gain,
            f"the trainer is the bottleneck: {best} rollout nodes give x{gain:.2f} trained tokens/s per node "
            f"(x{tput(best) / now:.2f} in all)",
        )  # fmt: skip
    why = f"at cluster.autoscale_max_nodes={max_nodes}" if r0 >= max_nodes else "no change gains"
    return ScaleDecision(r0, r0, 1.0, f"keep {r0} rollout nodes ({why} >= x{1 + min_gain:.2f})")
