"""Small-cluster guidance (launch/planning/layout/small_clusters.py) and the colocated schedule.

The guidance runs the real simulator on the paper
profile cut to few steps, and must return a split the placement can render, an eta from the
candidates, and an async/sync gain computed from its own simulated rows.
"""

from __future__ import annotations

import pytest
from test_launch_plan import make_job

from areal_jobs.config import Placement
from launch.planning.layout.allocation import choose_rollout_fraction
from launch.planning.layout.allocation import main as plan_allocation_main
from launch.planning.layout.placement import colocated_schedule
from launch.planning.layout.small_clusters import ETA_CANDIDATES, advise, gpu_profile
from launch.planning.sim.profile import load_profile

QUICK = ["run.warmup_steps=2", "run.measure_steps=2"]


def test_gpu_profile_makes_one_unit_per_server() -> None:
    p = gpu_profile(load_profile("paper_1p5b", ["cluster.rollout_tp=2"]), 8)
    assert (p.cluster.nodes, p.cluster.gpus_per_node) == (4, 2)
    with pytest.raises(ValueError, match="--gpus 2"):
        gpu_profile(load_profile("paper_1p5b", ["cluster.rollout_tp=2"]), 2)


def test_advice_for_eight_gpus_is_consistent() -> None:
    g = advise(load_profile("paper_1p5b", QUICK), 8, choose_rollout_fraction)
    assert g.rollout_gpus + g.trainer_gpus == 8 and 1 <= g.trainer_gpus <= 7
    assert g.eta in ETA_CANDIDATES and g.batch_size in (32, 64, 128, 256, 512)
    best_sync = max(g.sync.tokens_per_s, g.colocated.tokens_per_s)
    assert g.gain == pytest.approx(g.async_.tokens_per_s / best_sync)
    assert (g.sync.max_staleness, g.async_.max_staleness) == (0, g.eta)


def test_cli_prints_the_table(capsys) -> None:
    assert plan_allocation_main(["--gpus", "8", "--profile", "paper_1p5b", *QUICK]) == 0
    out = capsys.readouterr().out
    assert "| GPUs | split rollout + trainer | eta |" in out and "8 GPUs: cluster.nodes=1" in out


def test_colocated_schedule_is_synchronous() -> None:
    job = make_job(cluster={"nodes": 1, "placement": Placement.colocated}, algo={"max_staleness": 4})
    assert colocated_schedule(job).algo.max_staleness == 0
    other = make_job(cluster={"nodes": 1}, algo={"max_staleness": 4})
    assert colocated_schedule(other) is other
