"""Refused layouts name the overrides that make them work, computed by planning each candidate
(launch/planning/layout/suggest.py), and the plan line and layout comments say what the hostfiles do."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hydra import compose, initialize_config_dir

from areal_jobs.config import JobConfig, register_configs, to_job_config
from launch.planning.layout.placement import LayoutError
from launch.planning.layout.plan import plan_job
from launch.planning.layout.suggest import layout_fixes, plan_or_explain
from launch.slurm.golden import CONF_DIR
from launch.slurm.render import render_sbatch


def experiment(name: str, *overrides: str) -> JobConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_job_config(compose("submit", overrides=[f"experiment={name}", *overrides]))


def with_overrides(job: JobConfig, overrides: tuple[str, ...]) -> JobConfig:
    changes = {}
    for override in overrides:
        key, value = override.split("=", 1)
        changes[key.removeprefix("cluster.")] = value
    if "placement" in changes:
        changes["placement"] = type(job.cluster.placement)(changes["placement"])
    if "nodes" in changes:
        changes["nodes"] = int(changes["nodes"])
    return dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, **changes))


def test_math_7b_at_5_nodes_names_placement_nodes_first() -> None:
    job = experiment("math_qwen2_7b", "cluster.nodes=5")
    with pytest.raises(LayoutError) as refused:
        plan_or_explain(job)
    message = str(refused.value)
    assert message.startswith("trainer.tp_size=4 must divide the trainer's GPUs on each node")
    assert (
        "Layouts that work at 5 nodes, best first: cluster.placement=nodes (3 rollout + 2 trainer nodes"
        in message
    )
    fixes = layout_fixes(job)
    assert fixes[0].overrides == ("cluster.placement=nodes",)
    for fix in fixes:  # each one really plans, to the layout it names
        assert plan_job(with_overrides(job, fix.overrides)) == fix.plan


@pytest.mark.parametrize("placement", ["auto", "nodes", "gpus"])
def test_code_14b_at_10_nodes_needs_another_fraction_under_every_placement(placement: str) -> None:
    job = experiment("code_qwen2_14b", "cluster.nodes=10", f"cluster.placement={placement}")
    with pytest.raises(LayoutError, match=r"A layout that works|Layouts that work at 10 nodes") as refused:
        plan_or_explain(job)
    fixes = layout_fixes(job)
    assert fixes and all("cluster.rollout_fraction=0.8" in f.overrides for f in fixes[:1]), refused.value
    assert not any(
        o.startswith("cluster.placement") and len(f.overrides) == 1 for f in fixes for o in f.overrides
    )
    for fix in fixes:
        plan = plan_job(with_overrides(job, fix.overrides))
        assert plan == fix.plan and plan.trainer_gpus % 16 == 0


def test_a_smaller_cluster_is_pointed_to_the_nearest_node_count() -> None:
    job = experiment("code_qwen2_14b", "cluster.nodes=2")  # TP 8 x PP 2 needs 16 trainer GPUs
    fixes = layout_fixes(job)
    assert fixes[0].overrides[0] == "cluster.nodes=3"
    assert plan_job(with_overrides(job, fixes[0].overrides)) == fixes[0].plan


def test_no_layout_exists_and_the_refusal_says_why() -> None:
    job = experiment("math_qwen2_7b", "trainer.tp_size=16")  # TP never leaves an 8-GPU node
    with pytest.raises(LayoutError) as refused:
        plan_or_explain(job)
    assert "No layout works" in str(refused.value) and "trainer.tp_size=16" in str(refused.value)
    assert layout_fixes(job) == []


def test_a_layout_that_plans_is_returned_unchanged() -> None:
    job = experiment("math_qwen2_7b")
    assert plan_or_explain(job) == plan_job(job)


@pytest.mark.parametrize(
    ("overrides", "plan_line", "comments"),
    [
        (
            ["cluster.nodes=2", "cluster.placement=nodes", "trainer=fsdp"],
            "2 nodes x 8 GPUs = 1 rollout node (8 GPUs, 8 servers of TP 1) + 1 trainer node (8 GPUs, 8 ranks",
            [],
        ),
        (
            ["cluster.nodes=4", "cluster.placement=gpus", "trainer=fsdp"],
            "24 servers of TP 1 on nodes 1-3; 8 trainer ranks (TP 1 x PP 1 x DP 8) on GPUs 0-7 of node 4",
            ["# gpus placement: the servers use nodes 1-3;", "# the trainer uses GPUs 0-7 of node 4"],
        ),
        (
            ["cluster.nodes=1", "trainer=fsdp", "cluster.rollout_fraction=0.125"],
            "1 node x 8 GPUs, GPU-level split 1 + 7: 1 server of TP 1 on GPU 0 of node 1; 7 trainer ranks",
            ["# gpus placement: the servers use GPU 0 of node 1;", "# the trainer uses GPUs 1-7 of node 1"],
        ),
        (
            ["cluster.nodes=4", "cluster.rollout_fraction=0.65625", "trainer=fsdp"],
            "on nodes 1-2 + GPUs 0-4 of node 3; 11 trainer ranks (TP 1 x PP 1 x DP 11) on GPUs 5-7 of node 3 + node 4",
            ["# the trainer uses GPUs 5-7 of node 3 + node 4"],
        ),
    ],
)
def test_plan_line_and_layout_comments_say_what_runs_where(overrides, plan_line, comments) -> None:
    job = experiment("math_qwen2_1p5b", *overrides)
    job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, workdir="/w", python="/w/py"))
    plan = plan_job(job)
    assert plan_line in plan.describe()
    for bad in (
        r"\b1 nodes",
        r"\b1 (trainer|rollout|whole) nodes",
        r"\b0 whole",
        r"\b1 servers",
        r"\b1 GPUs",
        "GPUs 0--1",
    ):
        assert not re.search(bad, plan.describe()), bad
    script = render_sbatch(job, plan)
    for comment in comments:
        assert comment in script
    assert "0 whole node" not in script and "--1 " not in script
