"""GPU-level placement (launch/planning/layout/placement.py, launch/planning/layout/plan.py): splits worked out by hand.

8 GPUs per node, rollout fraction 0.75, rollout TP 1 unless stated:
  1 node:  floor(8 * 0.75) = 6 rollout GPUs, 2 trainer GPUs (6, 7) on the same node
  2 nodes: floor(16 * 0.75) = 12 -> node 1 all rollout, node 2 GPUs 0-3 rollout, 4-7 trainer
  3 nodes: floor(24 * 0.75) = 18 -> 8 + 8 + 2 rollout, trainer GPUs 2-7 of node 3 (DP 6)
  4 nodes: 4 * 0.75 = 3 whole nodes -> the heterogeneous job stays (24 + 8)
"""

from __future__ import annotations

import pytest
from test_launch_plan import make_job

from areal_jobs.config import ClusterConfig, ClusterKind, Placement, TrainerBackend
from launch.planning.layout.placement import split_gpus
from launch.planning.layout.plan import apply_plan, plan_job


def cluster(nodes: int, **kw) -> ClusterConfig:
    return ClusterConfig(kind=ClusterKind.slurm, nodes=nodes, gpus_per_node=8, **kw)


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        (1, (Placement.gpus, 0, 6, 1, 2, 6)),
        (2, (Placement.gpus, 1, 4, 1, 4, 4)),
        (3, (Placement.gpus, 2, 2, 1, 6, 2)),
        (4, (Placement.nodes, 3, 0, 1, 8, 0)),
        (64, (Placement.nodes, 48, 0, 16, 128, 0)),
        # 5 nodes: 30 rollout GPUs = 3 whole nodes + 6 of node 4; trainer GPUs 6, 7 of node 4 + node 5
        (5, (Placement.gpus, 3, 6, 2, 10, 6)),
    ],
)
def test_auto_splits(nodes: int, expected: tuple) -> None:
    s = split_gpus(cluster(nodes), rollout_tp=1)
    got = (s.placement, s.rollout_nodes, s.shared_rollout_gpus, s.trainer_nodes, s.trainer_gpus)
    assert (*got, s.trainer_first_gpu) == expected


def test_shared_node_keeps_whole_servers() -> None:
    # TP 4 on one node: 6 rollout GPUs hold one whole server (4 GPUs); the trainer gets the other 4
    s = split_gpus(cluster(1), rollout_tp=4)
    assert (s.shared_rollout_gpus, s.trainer_gpus, s.trainer_first_gpu) == (4, 4, 4)


def test_trainer_spans_the_shared_node_and_whole_nodes() -> None:
    # 4 x 8 at 21/32: 8 + 8 + 5 rollout GPUs; trainer GPUs 5-7 of node 3 and all 8 of node 4
    s = split_gpus(cluster(4, rollout_fraction="0.65625"), rollout_tp=1)
    assert (s.placement, s.rollout_nodes, s.shared_rollout_gpus, s.trainer_nodes) == (Placement.gpus, 2, 5, 2)
    assert (s.trainer_gpus, s.trainer_gpus_first_node, s.trainer_first_gpu) == (11, 3, 5)


def test_colocated_shares_every_gpu() -> None:
    s = split_gpus(cluster(1, placement=Placement.colocated), rollout_tp=2)
    assert (s.shared_rollout_gpus, s.trainer_gpus, s.trainer_first_gpu) == (8, 8, 0)


@pytest.mark.parametrize(
    ("kw", "names"),
    [
        ({"nodes": 2, "placement": Placement.colocated}, ["cluster.nodes=2", "cluster.nodes=1"]),
        ({"nodes": 1, "placement": Placement.nodes}, ["cluster.nodes>=2", "cluster.placement=gpus"]),
        ({"nodes": 1, "rollout_fraction": "0.1"}, ["leaves no whole server", "cluster.placement=colocated"]),
    ],
)
def test_impossible_placements_name_the_override(kw: dict, names: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        split_gpus(cluster(**kw), rollout_tp=1)
    for name in names:
        assert name in str(err.value)


def test_plan_of_one_node_split() -> None:
    plan = plan_job(make_job(cluster={"nodes": 1}))
    assert (plan.placement, plan.num_servers, plan.rollout_gpus) == (Placement.gpus, 6, 6)
    assert (plan.trainer_gpus, plan.trainer_world_size, plan.trainer_dp) == (2, 2, 2)
    assert plan.trainer_gpu_ids == "6,7"
    assert "GPU-level split 6 + 2" in plan.describe()


def test_plan_of_three_nodes() -> None:
    plan = plan_job(make_job(cluster={"nodes": 3}))
    assert (plan.nodes, plan.num_servers, plan.trainer_dp, plan.trainer_gpu_ids) == (3, 18, 6, "2,3,4,5,6,7")


def test_plan_of_a_trainer_over_two_nodes() -> None:
    plan = plan_job(make_job(cluster={"nodes": 4, "rollout_fraction": "0.65625"}))
    assert (plan.num_servers, plan.trainer_nodes, plan.trainer_world_size, plan.trainer_dp) == (21, 2, 11, 11)
    assert (plan.trainer_tasks_first_node, plan.trainer_tasks_per_node, plan.trainer_gpu_ids) == (
        3,
        8,
        "5,6,7",
    )
    with pytest.raises(ValueError, match=r"trainer\.tp_size=2 must divide .*\[3, 8\]"):
        plan_job(make_job(cluster={"nodes": 4, "rollout_fraction": "0.65625"}, trainer={"tp_size": 2}))


def test_torch_backend_needs_one_trainer_gpu() -> None:
    with pytest.raises(ValueError, match="trainer=fsdp"):
        plan_job(make_job(cluster={"nodes": 1}, trainer={"backend": TrainerBackend.torch}))
    # 1 node x 2 GPUs at 0.75: 1 rollout GPU, 1 trainer GPU: the single torch process fits
    plan = plan_job(
        make_job(cluster={"nodes": 1, "gpus_per_node": 2}, trainer={"backend": TrainerBackend.torch})
    )
    assert (plan.num_servers, plan.trainer_world_size, plan.trainer_gpu_ids) == (1, 1, "1")


def test_fsdp_backend_takes_every_trainer_gpu_as_dp() -> None:
    plan = plan_job(make_job(cluster={"nodes": 2}, trainer={"backend": TrainerBackend.fsdp}))
    assert (plan.trainer_world_size, plan.trainer_dp, plan.trainer_tp) == (4, 4, 1)


def test_colocated_plan_is_synchronous() -> None:
    job = make_job(cluster={"nodes": 1, "placement": Placement.colocated}, algo={"max_staleness": 4})
    plan = plan_job(job)
    assert (plan.num_servers, plan.trainer_world_size, plan.trainer_gpu_ids) == (8, 8, "0,1,2,3,4,5,6,7")
    assert apply_plan(job, plan).algo.max_staleness == 0
    assert "time-share" in plan.describe()
