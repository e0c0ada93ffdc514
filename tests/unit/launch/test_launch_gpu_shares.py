"""Dividing the memory of a GPU that servers and trainer ranks share (issue 28): colocated
placement and launch.local; every other layout keeps the engines' defaults."""

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
)
from launch.planning.fit.gpu_shares import RESERVE, local_shares, shares_for
from launch.planning.layout.plan import apply_plan, plan_job

GIB = 1 << 30


def job(placement: Placement, nodes: int = 1, **rollout) -> JobConfig:
    return JobConfig(
        cluster=ClusterConfig(kind=ClusterKind.slurm, nodes=nodes, gpus_per_node=8, placement=placement),
        rollout=RolloutConfig(**rollout),
        trainer=TrainerConfig(backend=TrainerBackend.fsdp),
        algo=AlgoConfig(batch_size=64, group_size=8),
    )


def test_colocated_gives_each_server_and_trainer_rank_its_share() -> None:
    planned = apply_plan(job(Placement.colocated), plan_job(job(Placement.colocated)))
    assert planned.rollout.release_memory_while_training and planned.algo.max_staleness == 0
    # one server and one rank per GPU: an even split of what the reserve leaves ...
    assert planned.rollout.gpu_memory_fraction == pytest.approx((1 - RESERVE) / 2)
    # ... and while the servers have released theirs the trainer may use all of it
    assert planned.trainer.gpu_memory_fraction == pytest.approx(1 - RESERVE)


@pytest.mark.parametrize(
    ("placement", "nodes"), [(Placement.nodes, 4), (Placement.gpus, 1), (Placement.gpus, 3)]
)
def test_layouts_without_a_shared_gpu_keep_the_engine_defaults(placement: Placement, nodes: int) -> None:
    planned = apply_plan(job(placement, nodes), plan_job(job(placement, nodes)))
    assert planned.rollout.gpu_memory_fraction == 0 and planned.trainer.gpu_memory_fraction == 0
    assert not planned.rollout.release_memory_while_training


def test_a_set_server_share_is_kept_and_the_trainer_gets_the_rest() -> None:
    released = job(Placement.colocated, gpu_memory_fraction=0.3, release_memory_while_training=True)
    shares = shares_for(released, servers_per_gpu=1, trainer_ranks_per_gpu=1)
    assert shares.server_fraction == 0.3 and shares.trainer_fraction == pytest.approx(1 - RESERVE)
    static = job(Placement.colocated, gpu_memory_fraction=0.3)  # no release: a static split
    shares = shares_for(static, servers_per_gpu=2, trainer_ranks_per_gpu=1)
    assert shares.trainer_fraction == pytest.approx(1 - RESERVE - 0.6)


def test_the_trainer_memory_model_decides_the_servers_share_when_it_is_known() -> None:
    shares = shares_for(job(Placement.colocated), 1, 1, trainer_bytes=30 * GIB, gpu_bytes=80 * GIB)
    assert shares.server_fraction == pytest.approx(1 - RESERVE - 30 / 80, abs=1e-4)


def test_launch_local_divides_gpu_zero_between_every_server_and_trainer_rank_zero() -> None:
    shares = local_shares(JobConfig(rollout=RolloutConfig(num_servers=2)))
    assert shares.servers_per_gpu == 2 and shares.server_fraction == pytest.approx(
        (1 - RESERVE) / 3, abs=1e-4
    )
    assert shares.trainer_fraction == pytest.approx((1 - RESERVE) / 3, abs=1e-4)
    assert "2 servers x 0.300 + 1 trainer rank x 0.300" in shares.describe()


@pytest.mark.parametrize(
    ("rollout", "servers", "fragment"),
    [
        ({"gpu_memory_fraction": 0.5}, 2, "lower rollout.gpu_memory_fraction"),  # leaves the trainer nothing
        ({}, 20, "lower rollout.num_servers"),  # 20 servers on one GPU
    ],
)
def test_a_share_too_small_to_run_is_refused_naming_the_override(rollout, servers, fragment) -> None:
    with pytest.raises(ValueError, match=fragment):
        shares_for(job(Placement.gpus, **rollout), servers_per_gpu=servers, trainer_ranks_per_gpu=1)
