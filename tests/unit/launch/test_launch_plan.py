"""The allocation planner: node split, servers per node, trainer layout, ports, and every error
naming the override that fixes it."""

from __future__ import annotations

import pytest

from areal_jobs.config import (
    AlgoConfig,
    ClusterConfig,
    ClusterKind,
    JobConfig,
    Placement,
    RolloutConfig,
    TrainerBackend,
    TrainerConfig,
    WeightSyncConfig,
)
from launch.planning.layout.plan import DEFAULT_SERVER_BASE_PORT, apply_plan, plan_job


def make_job(
    *,
    cluster: dict | None = None,
    rollout: dict | None = None,
    trainer: dict | None = None,
    algo: dict | None = None,
    weight_sync: dict | None = None,
) -> JobConfig:
    """An H800-like SLURM job with a Megatron trainer, adjusted by per-slice overrides."""
    trainer_args = {"backend": TrainerBackend.megatron, **(trainer or {})}
    return JobConfig(
        cluster=ClusterConfig(
            **{"kind": ClusterKind.slurm, "nodes": 64, "gpus_per_node": 8, **(cluster or {})}
        ),
        rollout=RolloutConfig(**(rollout or {})),
        trainer=TrainerConfig(**trainer_args),
        algo=AlgoConfig(**{"batch_size": 512, "group_size": 16, **(algo or {})}),
        weight_sync=WeightSyncConfig(**(weight_sync or {})),
    )


def test_64_nodes_split_into_48_rollout_and_16_trainer_nodes() -> None:
    plan = plan_job(make_job())
    assert (plan.rollout_nodes, plan.trainer_nodes) == (48, 16)
    assert (plan.rollout_gpus, plan.servers_per_node, plan.num_servers) == (384, 8, 384)
    assert (plan.trainer_gpus, plan.trainer_world_size) == (128, 128)
    assert (plan.trainer_tp, plan.trainer_pp, plan.trainer_dp) == (1, 1, 128)
    assert "48 rollout nodes (384 GPUs, 384 servers of TP 1)" in plan.describe()


@pytest.mark.parametrize(
    ("nodes", "rollout_tp", "trainer_tp", "trainer_pp", "expected"),
    [
        (64, 1, 1, 1, (48, 384, 16, 128)),  # math 1.5B
        (16, 2, 4, 1, (12, 48, 4, 8)),  # math 7B
        (32, 2, 8, 2, (24, 96, 8, 4)),  # code 14B
    ],
)
def test_reference_layouts(nodes, rollout_tp, trainer_tp, trainer_pp, expected) -> None:
    plan = plan_job(
        make_job(
            cluster={"nodes": nodes},
            rollout={"tp_size": rollout_tp},
            trainer={"tp_size": trainer_tp, "pp_size": trainer_pp},
        )
    )
    assert (plan.rollout_nodes, plan.num_servers, plan.trainer_nodes, plan.trainer_dp) == expected
    assert plan.trainer_tp * plan.trainer_pp * plan.trainer_dp == plan.trainer_gpus


def test_local_slurm_layout_is_three_cpu_servers_and_one_torch_trainer() -> None:
    job = JobConfig(
        cluster=ClusterConfig(kind=ClusterKind.slurm, nodes=4, gpus_per_node=1, loopback=True),
        trainer=TrainerConfig(backend=TrainerBackend.torch),
    )
    plan = plan_job(job)
    assert (plan.rollout_nodes, plan.num_servers, plan.trainer_nodes, plan.trainer_world_size) == (3, 3, 1, 1)


def test_rollout_share_rounds_down_without_float_error() -> None:
    # 30 * 0.7 is 20.999... in floating point; 10 * 0.75 = 7.5 rounds down to 7
    assert plan_job(make_job(cluster={"nodes": 30, "rollout_fraction": 0.7})).rollout_nodes == 21
    assert plan_job(make_job(cluster={"nodes": 10, "rollout_fraction": 0.75})).rollout_nodes == 7
    # rounding down always leaves a trainer node
    assert plan_job(make_job(cluster={"nodes": 2, "rollout_fraction": 0.99})).trainer_nodes == 1


def test_servers_per_node_override_leaves_gpus_idle() -> None:
    plan = plan_job(make_job(cluster={"servers_per_node": 2}, rollout={"tp_size": 2}))
    assert (plan.servers_per_node, plan.num_servers) == (2, 96)


def test_apply_plan_writes_what_the_roles_read() -> None:
    job = make_job(cluster={"nodes": 16}, trainer={"tp_size": 4}, rollout={"num_servers": 1})
    planned = apply_plan(job, plan_job(job))
    assert planned.rollout.num_servers == 96
    assert planned.rollout.base_port == DEFAULT_SERVER_BASE_PORT
    assert planned.rollout.controller_port > 0 and planned.weight_sync.master_port > 0
    assert (planned.trainer.tp_size, planned.trainer.pp_size, planned.trainer.dp_size) == (4, 1, 8)
    assert planned.algo == job.algo and planned.cluster == job.cluster


def test_configured_ports_are_kept() -> None:
    plan = plan_job(
        make_job(rollout={"base_port": 40000, "controller_port": 41000}, weight_sync={"master_port": 42000})
    )
    assert (plan.server_base_port, plan.controller_port, plan.weight_sync_port) == (40000, 41000, 42000)


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (
            {"cluster": {"nodes": 1, "placement": Placement.nodes}},
            ["cluster.nodes=1", "cluster.nodes>=2", "cluster.placement=gpus"],
        ),
        (
            {"cluster": {"nodes": 4, "rollout_fraction": 0.1, "placement": Placement.nodes}},
            ["raise cluster.rollout_fraction"],
        ),
        ({"rollout": {"tp_size": 3}}, ["rollout.tp_size=3", "[1, 2, 4, 8]"]),
        ({"rollout": {"tp_size": 16}}, ["rollout.tp_size=16"]),
        ({"cluster": {"servers_per_node": 5}, "rollout": {"tp_size": 2}}, ["cluster.servers_per_node<=4"]),
        ({"trainer": {"backend": TrainerBackend.torch}}, ["trainer=megatron", "128 GPUs"]),
        ({"trainer": {"tp_size": 16, "megatron_vocab_multiple": 128}}, ["trainer.tp_size=16"]),
        ({"cluster": {"nodes": 8}, "trainer": {"tp_size": 8, "pp_size": 3}}, ["trainer.pp_size"]),
        ({"trainer": {"dp_size": 4}}, ["trainer.dp_size=4", "DP 128"]),
        ({"algo": {"batch_size": 4, "group_size": 8}}, ["algo.batch_size", "128 data-parallel"]),
        ({"rollout": {"controller_port": 29500}}, ["cluster.master_port", "port 29500"]),
        ({"rollout": {"controller_port": 29699}}, ["weight_sync.master_port", "rollout.controller_port+1"]),
        ({"rollout": {"base_port": 65500}}, ["rollout.base_port=65500"]),
    ],
)
def test_impossible_layouts_name_the_override(overrides: dict, names: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        plan_job(make_job(**overrides))
    for name in names:
        assert name in str(err.value)


def test_loopback_checks_every_server_port_against_the_trainer_node() -> None:
    job = JobConfig(
        cluster=ClusterConfig(kind=ClusterKind.slurm, nodes=4, gpus_per_node=1, loopback=True),
        rollout=RolloutConfig(base_port=29498),  # servers 29498..29500 hit cluster.master_port
    )
    with pytest.raises(ValueError, match=r"rollout.base_port\+2"):
        plan_job(job)
    # off loopback, servers run on other hosts than the controller: no clash
    plan_job(JobConfig(cluster=ClusterConfig(kind=ClusterKind.slurm, nodes=4, gpus_per_node=1)))


@pytest.mark.parametrize(
    ("field", "value", "name"),
    [
        ("time_limit", "1h", "cluster.time_limit"),
        ("nccl_env", {"NCCL-IB": "x"}, "cluster.nccl_env"),
        ("requeue_signal_s", 70000, "cluster.requeue_signal_s"),
        ("gpus_per_node", 0, "cluster.gpus_per_node"),
        ("master_port", 0, "cluster.master_port"),
    ],
)
def test_cluster_config_rejects_bad_values(field: str, value, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ClusterConfig(**{field: value})


@pytest.mark.parametrize("limit", ["30", "30:00", "24:00:00", "2-00", "2-12:00", "3-00:00:00"])
def test_cluster_config_accepts_slurm_time_formats(limit: str) -> None:
    assert ClusterConfig(time_limit=limit).time_limit == limit
