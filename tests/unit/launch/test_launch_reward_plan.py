"""Reward-model servers as the third component of the heterogeneous job: the split, the plan
line, the render, and the planner's refusals (no reward nodes, a layout whose reward servers
cannot keep up with the rollout, a model that does not fit)."""

from __future__ import annotations

import dataclasses

import pytest

from areal_jobs.config import (
    AlgoConfig,
    ClusterConfig,
    ClusterKind,
    JobConfig,
    ModelConfig,
    Placement,
    RewardConfig,
    RewardModelConfig,
    RewardSource,
    RolloutConfig,
    TrainerBackend,
    TrainerConfig,
)
from launch.planning.fit.reward_plan import check_reward_servers, rollout_answers_per_s
from launch.planning.layout.plan import apply_plan, plan_job
from launch.slurm.render import render_sbatch


def rm_job(reward_nodes: int = 5, answers_per_s: float = 20.0, **cluster) -> JobConfig:
    """math_qwen2_1p5b_rm's shape: 64 H800 nodes, a 1.5B classifier on its own nodes."""
    return JobConfig(
        cluster=ClusterConfig(
            kind=ClusterKind.slurm,
            nodes=64,
            gpus_per_node=8,
            reward_nodes=reward_nodes,
            workdir="/shared/job",
            python="python",
            **cluster,
        ),  # fmt: skip
        model=ModelConfig(path="/nowhere/policy", shape="qwen2_1p5b"),
        rollout=RolloutConfig(max_new_tokens=16384, max_concurrent=16384),
        trainer=TrainerConfig(backend=TrainerBackend.megatron),
        algo=AlgoConfig(batch_size=512, group_size=16),
        reward=RewardConfig(
            source=RewardSource.combined,
            model=RewardModelConfig(path="/nowhere/rm", shape="qwen2_1p5b", answers_per_s=answers_per_s),
        ),
    )


def test_reward_nodes_are_set_aside_and_the_rest_split_by_the_rollout_fraction():
    plan = plan_job(rm_job())
    assert (plan.reward_nodes, plan.rollout_nodes, plan.trainer_nodes) == (5, 44, 15)  # 59 x 0.75 -> 44
    assert plan.placement is Placement.nodes and plan.num_reward_servers == 40 and plan.nodes == 64
    line = plan.describe()
    assert "44 rollout nodes" in line and "15 trainer nodes" in line
    assert line.endswith("+ 5 reward nodes (40 GPUs, 40 reward-model servers of TP 1)")
    planned = apply_plan(rm_job(), plan)
    assert planned.reward.model.num_servers == 40 and planned.reward.model.base_port == plan.reward_base_port


def test_the_fraction_gives_at_least_one_reward_node():
    job = rm_job(reward_nodes=0, reward_fraction=0.01)
    assert plan_job(job).reward_nodes == 1  # 64 x 0.01 rounds down to 0: one node all the same


def test_the_render_has_three_components_and_supervised_reward_servers():
    job = rm_job()
    plan = plan_job(job)
    script = render_sbatch(apply_plan(job, plan), plan)
    assert script.count("#SBATCH hetjob") == 2
    assert "# component: 2 = reward-model servers" in script
    assert "#SBATCH --nodes=5 --ntasks-per-node=8" in script
    assert "srun --het-group=2 --ntasks-per-node=8 --job-name=areal-reward-servers" in script
    assert 'areal_jobs.rollout.supervise --config "$CONFIG" --index "$SLURM_PROCID" --reward' in script
    assert 'failed="reward-model servers"' in script  # all of them gone ends the job, as for rollout


def test_reward_servers_that_cannot_keep_up_are_refused_naming_enough_nodes():
    needed = rollout_answers_per_s(rm_job(reward_nodes=4), plan_job(rm_job(reward_nodes=4)))
    assert 32 * 20 < needed < 40 * 20  # 4 nodes fall short, 5 keep up
    with pytest.raises(ValueError, match=r"cannot keep up.*cluster\.reward_nodes=5"):
        check_reward_servers(rm_job(reward_nodes=4), plan_job(rm_job(reward_nodes=4)))
    report = check_reward_servers(rm_job(), plan_job(rm_job()))
    assert report.capacity_answers_per_s == 800 and "keep up: 40 x 20 answers/s" in report.describe()


def test_without_a_measured_rate_the_check_says_it_was_skipped():
    report = check_reward_servers(rm_job(answers_per_s=0), plan_job(rm_job(answers_per_s=0)))
    assert "not checked (reward.model.answers_per_s=0)" in report.describe()


def test_a_reward_model_that_does_not_fit_is_refused():
    job = rm_job()
    big = dataclasses.replace(job.reward.model, shape="qwen2_14b", batch_size=4096)
    job = dataclasses.replace(job, reward=dataclasses.replace(job.reward, model=big))
    with pytest.raises(ValueError, match=r"reward\.model\.batch_size"):
        check_reward_servers(job, plan_job(job))


@pytest.mark.parametrize(
    ("change", "override"),
    [
        (dict(reward_nodes=0), "cluster.reward_nodes"),  # a model to serve, no nodes for it
        (dict(placement=Placement.gpus), "cluster.placement=nodes"),
        (dict(rollout_fraction="auto"), "cluster.rollout_fraction"),
    ],
)
def test_layout_refusals_name_the_override(change, override):
    job = rm_job()
    job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, **change))
    with pytest.raises(ValueError, match=override.replace(".", r"\.")):
        plan_job(job)


def test_reward_nodes_without_a_reward_model_are_refused():
    job = dataclasses.replace(rm_job(), reward=RewardConfig())
    with pytest.raises(ValueError, match=r"reward\.source=verifier"):
        plan_job(job)


def test_cluster_refuses_reward_nodes_that_leave_no_room():
    with pytest.raises(ValueError, match=r"cluster\.reward_nodes"):
        ClusterConfig(nodes=3, reward_nodes=2)
