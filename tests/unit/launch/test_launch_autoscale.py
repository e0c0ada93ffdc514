"""Autoscale (launch/planning/replanning/autoscale.py): how many rollout nodes beside a fixed trainer, by hand-worked
throughput curves, and once on the simulator."""

from __future__ import annotations

import copy

import pytest
from test_launch_simulate import SMALL  # the small 8-node profile the simulator tests use

from launch.planning.replanning.autoscale import pool_throughput, scale_decision
from launch.planning.sim.engine import run_async
from launch.planning.sim.profile import load_profile


def saturating(r: int) -> float:
    """100 trained tok/s per rollout node until the trainer's 250 tok/s: two and a half nodes."""
    return min(100.0 * r, 250.0)


def test_grows_when_generation_is_the_bottleneck():
    d = scale_decision(saturating, trainer_nodes=1, rollout_nodes=1, max_nodes=4, min_gain=0.1)
    # 2 nodes: 200 / 100 = x2.0 >= x1.1, the fewest that pass
    assert (d.target_nodes, d.change, d.expected_gain) == (2, 1, 2.0)
    assert "generation is the bottleneck" in d.reason
    assert d.metrics() == {"plan/autoscale_target_nodes": 2.0, "plan/autoscale_gain": 2.0}
    # asking x2.2: 2 nodes (x2.0) do not pass, 3 (250 / 100 = x2.5) do
    d = scale_decision(saturating, trainer_nodes=1, rollout_nodes=1, max_nodes=4, min_gain=1.2)
    assert (d.target_nodes, d.expected_gain) == (3, 2.5)


def test_shrinks_idle_rollout_when_the_trainer_is_the_bottleneck():
    # per node (rollout + 1 trainer): 4 -> 250/5 = 50, 3 -> 62.5, 2 -> 200/3 = 66.7, 1 -> 50; but 2
    # nodes keep 200 / 250 = 0.8 of the throughput, below 1 / 1.1: the 4th node goes, not the 3rd
    d = scale_decision(saturating, trainer_nodes=1, rollout_nodes=4, max_nodes=4, min_gain=0.1)
    assert d.target_nodes == 3 and d.change == -1
    assert d.expected_gain == pytest.approx(62.5 / 50)  # x1.25 per node
    assert "the trainer is the bottleneck" in d.reason and "x1.00 in all" in d.reason
    # a tolerance of 30% lets the pool shrink to the best per node, 2
    d = scale_decision(saturating, trainer_nodes=1, rollout_nodes=4, max_nodes=4, min_gain=0.3)
    assert d.target_nodes == 2 and d.expected_gain == pytest.approx((200 / 3) / 50)


def test_keeps_the_pool_below_the_gain_threshold():
    # 3 nodes: growing to 4 adds nothing (250 = 250); shrinking to 2 gains 66.7 / 62.5 = x1.07 < x1.1
    d = scale_decision(saturating, trainer_nodes=1, rollout_nodes=3, max_nodes=4, min_gain=0.1)
    assert (d.target_nodes, d.change, d.expected_gain) == (3, 0, 1.0)
    # any gain at all is enough with min_gain 0, but then no throughput may be lost: 2 nodes keep 0.8
    d = scale_decision(saturating, trainer_nodes=1, rollout_nodes=3, max_nodes=4, min_gain=0.0)
    assert d.change == 0


def test_never_grows_past_max_nodes():
    # rollout-bound all the way (100 tok/s per node, no trainer limit) but already at the ceiling
    d = scale_decision(lambda r: 100.0 * r, trainer_nodes=1, rollout_nodes=2, max_nodes=2, min_gain=0.1)
    assert d.change == 0 and "cluster.autoscale_max_nodes=2" in d.reason
    d = scale_decision(lambda r: 100.0 * r, trainer_nodes=1, rollout_nodes=2, max_nodes=9, min_gain=0.1)
    assert d.target_nodes == 3 and d.expected_gain == 1.5
    with pytest.raises(ValueError, match="min_gain"):
        scale_decision(saturating, 1, 1, 4, -0.1)


def test_simulated_pool_grows_when_the_trainer_waits():
    # the small profile with a fast trainer and servers holding 4 sequences each: one rollout node
    # cannot feed two trainer nodes, a second doubles the throughput
    p = load_profile(
        "paper_1p5b",
        [
            *SMALL,
            "trainer.tokens_per_s_per_gpu=160000",
            "trainer.weight_sync_s=0.1",
            "rollout.max_batch_per_gpu=4",
        ],
    )
    tput = pool_throughput(p, 2, 1)
    d = scale_decision(tput, 2, 1, 8, 0.1)
    assert d.target_nodes == 2
    assert d.expected_gain == pytest.approx(tput(2) / tput(1)) and d.expected_gain > 1.5
    q = copy.deepcopy(p)
    q.cluster.nodes = 4  # 8 in the profile, 2 + 2 here
    assert tput(2) == run_async(q, 2 / 4).tokens_per_s


def test_a_pool_that_expires_more_groups_does_not_count():
    # eta 1, 8 sequences per GPU, 4 trainer nodes: 1 rollout node expires 24 of 256 trained groups,
    # 2 nodes 34 (more long answers outrun eta): 2 nodes count 0 although they train more tokens/s
    p = load_profile("paper_1p5b", [*SMALL, "algo.max_staleness=1", "rollout.max_batch_per_gpu=8"])
    tput = pool_throughput(p, 4, 1)
    q = copy.deepcopy(p)
    q.cluster.nodes = 6
    raw = run_async(q, 2 / 6)
    assert (raw.expired_groups, raw.extra["trained_groups"]) == (34, 256)
    assert raw.tokens_per_s > tput(1) > 0 and tput(2) == 0.0
    assert scale_decision(tput, 4, 1, 4, 0.1).change == 0  # so autoscale does not grow into it
