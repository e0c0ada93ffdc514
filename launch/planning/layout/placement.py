"""Which GPUs each role gets: whole nodes, a GPU-level split, or colocated (`cluster.placement`).

Pure functions of the cluster slice and the rollout TP size, no I/O; launch/planning/layout/plan.py builds the
full plan on top (trainer layout, ports). Three layouts:

  nodes      one heterogeneous job: floor(nodes * fraction) rollout nodes, the rest trainer nodes.
  gpus       one job over whole nodes: the rollout servers take floor(total GPUs * fraction) GPUs,
             whole nodes first, then GPUs 0..k-1 of the next ("shared") node (servers never span
             nodes, so k is rounded down to whole TP groups); the trainer takes the rest: the
             shared node's remaining GPUs and every later node.
  colocated  one node: the servers use every GPU and so does the trainer; they time-share them
             with the synchronous schedule (algo.max_staleness=0: no generation while training).

`auto` keeps the whole-node hetjob where nodes * fraction is a whole number (the paper's 64 x 0.75),
else the GPU-level split.

Worked examples, 8 GPUs per node, fraction 0.75, rollout TP 1:
  1 node   8 GPUs -> gpus: 6 rollout + 2 trainer on node 1
  2 nodes 16 GPUs -> gpus: 8 + 4 rollout, 4 trainer on node 2 (12 + 4)
  3 nodes 24 GPUs -> gpus: 8 + 8 + 2 rollout, 6 trainer on node 3 (18 + 6)
  4 nodes 32 GPUs -> nodes: 3 rollout nodes + 1 trainer node (24 + 8)
  4 nodes at 21/32 -> gpus: 8 + 8 + 5 rollout, trainer on GPUs 5-7 of node 3 and all of node 4 (21 + 11)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from areal_jobs.config import ClusterConfig, JobConfig, Placement


class LayoutError(ValueError):
    """A split of the nodes or GPUs that cannot run; another cluster.placement, rollout_fraction or
    node count may (launch/planning/layout/suggest.py searches for one)."""


@dataclass(frozen=True)
class GpuSplit:
    """Where the roles run. Rollout servers fill `rollout_nodes` whole nodes, then
    `shared_rollout_gpus` GPUs (from GPU 0) of the first trainer node; the trainer uses that node's
    GPUs from `trainer_first_gpu` on and every GPU of its other `trainer_nodes - 1` nodes."""

    placement: Placement  # resolved: never auto
    gpus_per_node: int
    rollout_nodes: int  # nodes whose every GPU serves
    shared_rollout_gpus: int  # rollout GPUs on the first trainer node (gpus, colocated); 0 for nodes
    trainer_nodes: int  # the shared node (if any) and every node after it
    trainer_first_gpu: int  # first trainer GPU on the first trainer node (gpus: after the servers')

    @property
    def trainer_gpus(self) -> int:
        return self.trainer_nodes * self.gpus_per_node - self.trainer_first_gpu

    @property
    def trainer_gpus_first_node(self) -> int:
        return self.gpus_per_node - self.trainer_first_gpu


def node_split(cluster: ClusterConfig) -> GpuSplit:
    """Whole nodes: the rollout share is rounded down (fraction < 1, so at least one trainer node
    remains) and must leave at least one rollout node."""
    if cluster.nodes < 2:
        raise LayoutError(
            f"cluster.nodes={cluster.nodes}: cluster.placement=nodes needs at least one rollout node and one "
            "trainer node: set cluster.nodes>=2, or cluster.placement=gpus (or auto) to split the GPUs of "
            "one node, or cluster.placement=colocated"
        )
    # the epsilon keeps 30 * 0.7 = 20.999... from rounding down to 20
    rollout_nodes = math.floor(cluster.nodes * cluster.rollout_share + 1e-9)
    if rollout_nodes < 1:
        raise LayoutError(
            f"cluster.rollout_fraction={cluster.rollout_fraction} of cluster.nodes={cluster.nodes} leaves no "
            "rollout node: raise cluster.rollout_fraction or cluster.nodes, or use cluster.placement=gpus"
        )
    trainer_nodes = cluster.nodes - rollout_nodes
    return GpuSplit(Placement.nodes, cluster.gpus_per_node, rollout_nodes, 0, trainer_nodes, 0)


def gpu_split(cluster: ClusterConfig, rollout_tp: int) -> GpuSplit:
    """GPU-level: servers on the first GPUs in node order, the trainer on the rest (module docstring)."""
    gpn, total = cluster.gpus_per_node, cluster.nodes * cluster.gpus_per_node
    rollout = math.floor(total * cluster.rollout_share + 1e-9)
    whole, rest = divmod(rollout, gpn)
    shared = rest // rollout_tp * rollout_tp  # servers never span nodes: whole TP groups
    if whole == 0 and shared == 0:
        raise LayoutError(
            f"cluster.placement=gpus: rollout_fraction={cluster.rollout_fraction} of {total} GPUs leaves no "
            f"whole server of rollout.tp_size={rollout_tp}: raise cluster.rollout_fraction, lower "
            "rollout.tp_size, or use cluster.placement=colocated"
        )
    return GpuSplit(Placement.gpus, gpn, whole, shared, cluster.nodes - whole, shared)


def colocated_split(cluster: ClusterConfig) -> GpuSplit:
    if cluster.nodes != 1:
        raise LayoutError(
            f"cluster.placement=colocated runs on one node, not cluster.nodes={cluster.nodes}: set "
            "cluster.nodes=1, or cluster.placement=gpus / nodes for several nodes"
        )
    gpn = cluster.gpus_per_node
    return GpuSplit(Placement.colocated, gpn, 0, gpn, 1, 0)


def exact_node_split(cluster: ClusterConfig) -> bool:
    """Whole nodes give exactly the requested fraction (nodes * fraction is a whole number)."""
    share = cluster.nodes * cluster.rollout_share
    return cluster.nodes >= 2 and abs(share - round(share)) < 1e-9


def split_gpus(cluster: ClusterConfig, rollout_tp: int) -> GpuSplit:
    """The split for `cluster.placement`; `auto` tries whole nodes, then GPUs (module docstring).
    Raises ValueError naming the override when the layout is impossible."""
    match cluster.placement:
        case Placement.nodes:
            return node_split(cluster)
        case Placement.gpus:
            return gpu_split(cluster, rollout_tp)
        case Placement.colocated:
            return colocated_split(cluster)
    if exact_node_split(cluster):
        return node_split(cluster)
    return gpu_split(cluster, rollout_tp)


def colocated_schedule(job: JobConfig) -> JobConfig:
    """cluster.placement=colocated: the synchronous schedule (algo.max_staleness=0), so no request
    is generated while the trainer uses the devices the servers share, and the servers free their
    GPU memory while it steps (rollout.release_memory_while_training; launch.planning.layout.plan, launch.local)."""
    if job.cluster.placement is not Placement.colocated:
        return job
    if job.algo.max_staleness == 0 and job.rollout.release_memory_while_training:
        return job
    return dataclasses.replace(
        job,
        algo=dataclasses.replace(job.algo, max_staleness=0),
        rollout=dataclasses.replace(job.rollout, release_memory_while_training=True),
    )
