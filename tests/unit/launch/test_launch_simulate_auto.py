"""The simulator models algo.max_staleness=auto: each trained batch's drift (linear in its lag,
SimProfile.drift) goes through the controller's law, which sets the admission bound; a simulated
run shows the bound adapting, and with a drift that never passes the target it is the fixed run."""

from __future__ import annotations

import math

from launch.planning.reports.simulate import eta_markdown, main
from launch.planning.sim.engine import run_async
from launch.planning.sim.profile import load_profile
from launch.planning.sim.sweep import staleness_sweep, with_eta

# generation runs ahead of the trainer here (trainer-heavy): a fixed eta = 8 trains 7.8 versions old
SMALL = [
    "cluster.nodes=8", "algo.batch_size=32", "algo.group_size=4", "algo.max_concurrent=256",
    "lengths.median_tokens=800", "lengths.max_tokens=8192", "run.warmup_steps=4", "run.measure_steps=80",
    "algo.max_staleness=8", "algo.staleness_auto=true",
]  # fmt: skip


def auto(*extra: str):
    return load_profile("trainer_heavy_7b", [*SMALL, *extra])


def test_a_drift_that_grows_with_the_lag_brings_the_bound_down_to_the_level_that_meets_the_target():
    p = auto("drift.per_version=0.02")  # 2% per version of lag: the target (3%) is met at lag 1.5
    r, fixed8 = run_async(p), run_async(with_eta(p, 8))
    level = math.floor(p.algo.staleness_drift_target / p.drift.per_version)  # 1
    assert r.bounds[0] == 8 and r.bounds[-1] == level and min(r.bounds) == level
    assert set(r.bounds[20:]) == {level}  # it stays there: no oscillation
    assert fixed8.staleness_mean > 7 and fixed8.drift_mean > 0.15  # what the fixed bound trains on
    assert r.staleness_mean < 1.5 and r.drift_mean <= p.algo.staleness_drift_target
    # throughput between the fixed bounds the law moved between
    fixed1 = run_async(with_eta(p, 1))
    assert fixed1.tokens_per_s < r.tokens_per_s < fixed8.tokens_per_s


def test_a_drift_below_the_target_keeps_the_ceiling_and_the_fixed_schedule():
    p = auto("drift.per_version=0.001")
    r, fixed8 = run_async(p), run_async(with_eta(p, 8))
    assert set(r.bounds) == {8}
    assert r.tokens_per_s == fixed8.tokens_per_s and r.staleness_mean == fixed8.staleness_mean


def test_the_bound_rises_again_when_the_drift_falls_and_runs_are_deterministic():
    # 2% a version until version 60, then 0.1% (the policy moves less per version later on)
    p = auto(
        "drift.per_version=0.02", "drift.noise=0.3", "drift.late_per_version=0.001",
        "drift.late_from_version=60", "run.measure_steps=200",
    )  # fmt: skip
    a, b = run_async(p), run_async(p)
    assert a.bounds == b.bounds and a.tokens_per_s == b.tokens_per_s
    assert min(a.bounds[:60]) <= 2  # cut while the drift was high
    assert a.bounds[-1] == 8  # and back at the ceiling once it fell
    after = a.bounds[60:]
    moves = [y - x for x, y in zip(after, after[1:]) if y != x]
    assert moves and all(step == 1 for step in moves)  # one version at a time, never back down


def test_the_simulate_report_has_an_auto_row(tmp_path, capsys):
    p = auto("drift.per_version=0.02")
    rows = staleness_sweep(p, (0, 8))
    assert [bool(r.bounds) for r in rows] == [False, False, True]
    assert "auto <= 8 (last 1, 1-8)" in eta_markdown(rows)
    args = ["--profile", "trainer_heavy_7b", "--gpus", "64", "--etas", "0,8", "--out", str(tmp_path)]
    assert main([*args, *SMALL, "drift.per_version=0.02", "run.measure_steps=30"]) == 0
    assert "auto <= 8" in (tmp_path / "simulate.md").read_text()
