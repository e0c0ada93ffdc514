"""Sweeps over the simulator: throughput against cluster size (async / sync / colocated) and
against the staleness bound eta. Pure: rows in, rows out; launch.simulate prints and plots them."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from launch.planning.sim.engine import SimResult, run_async, run_sync
from launch.planning.sim.profile import SimProfile

DEFAULT_GPUS = (64, 128, 256, 512)
DEFAULT_ETAS = (0, 1, 2, 4, 8)


@dataclass(frozen=True)
class ScalingRow:
    gpus: int
    async_: SimResult
    sync: SimResult
    colocated: SimResult
    efficiency: float  # async tokens/s per GPU relative to the smallest cluster of the sweep

    @property
    def async_over_sync(self) -> float:
        return self.async_.tokens_per_s / self.sync.tokens_per_s

    @property
    def async_over_colocated(self) -> float:
        return self.async_.tokens_per_s / self.colocated.tokens_per_s


def with_nodes(p: SimProfile, gpus: int) -> SimProfile:
    if gpus % p.cluster.gpus_per_node:
        raise ValueError(f"{gpus} GPUs is not a whole number of {p.cluster.gpus_per_node}-GPU nodes")
    q = copy.deepcopy(p)
    q.cluster.nodes = gpus // p.cluster.gpus_per_node
    q.cluster.check()
    return q


def with_eta(p: SimProfile, eta: int) -> SimProfile:
    """A fixed bound eta (algo.staleness_auto off)."""
    q = copy.deepcopy(p)
    q.algo.max_staleness = eta
    q.algo.staleness_auto = False
    return q


def scaling(p: SimProfile, gpus: tuple[int, ...] = DEFAULT_GPUS) -> list[ScalingRow]:
    rows: list[ScalingRow] = []
    for n in gpus:
        q = with_nodes(p, n)
        a, s, c = run_async(q), run_sync(q), run_sync(q, colocated=True)
        per_gpu = a.tokens_per_s / n
        base = rows[0].async_.tokens_per_s / rows[0].gpus if rows else per_gpu
        rows.append(ScalingRow(n, a, s, c, per_gpu / base))
    return rows


def staleness_sweep(p: SimProfile, etas: tuple[int, ...] = DEFAULT_ETAS) -> list[SimResult]:
    """Fixed bounds, then (algo.staleness_auto) the auto bound under the profile's ceiling."""
    fixed = [run_async(with_eta(p, eta)) for eta in etas]
    return fixed + ([run_async(p)] if p.algo.staleness_auto else [])
