"""Online re-planning in a real launch.local run (real SGLang servers, controller, torch trainer):
the re-planner beside the job reads the run's metrics every `cluster.replan_every_steps` steps and
writes plan/* rows; with `cluster.autoscale=true` and a profile in which generation is the
bottleneck (tests/fixtures/sim/rollout_bound.yaml) it adds a rollout server by itself, which joins
at a weight update and then serves requests. One run checks both (one stack start, not two).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from areal_jobs.metrics import read_jsonl

from .test_e2e_elastic import scale, wait_for_log
from .test_e2e_local import ledger, start_local, wait_for_steps

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

ROLLOUT_BOUND = Path(__file__).resolve().parents[2] / "fixtures" / "sim" / "rollout_bound.yaml"


def plan_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "plan/expected_gain" in r]


def check_replans(run_dir: Path, every_steps: int, record_property) -> list[dict]:
    """The re-planner beside the job: every `every_steps` trained steps a plan/* row, from what it
    fits (the trainer's per-step length statistics and train speed). Returns the plan rows."""
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/version" in r]
    assert all("gen/len_log_var_within" in r and r["throughput/train_tokens_per_s"] > 0 for r in steps)
    plans = plan_rows(run_dir)
    assert plans, f"no re-plan in {len(steps)} steps with cluster.replan_every_steps={every_steps}"
    for row in plans:
        assert row["step"] % every_steps == 0
        assert 0 < row["plan/recommended_rollout_fraction"] < 1 and row["plan/expected_gain"] >= 1.0
        assert row["plan/gen_tokens_per_s_per_gpu"] > 0 and row["plan/train_tokens_per_s_per_gpu"] > 0
    record_property("replan_s_max", round(max(r["plan/replan_s"] for r in plans), 3))
    print(f"\n{len(plans)} re-plans, each {max(r['plan/replan_s'] for r in plans):.3f}s at most")
    return plans


def test_autoscale_adds_a_server_that_receives_work(tmp_path, tiny_model_dir, record_property):
    run_dir = tmp_path / "autoscale"
    proc = start_local(
        tmp_path, tiny_model_dir, "autoscale", "algo.max_staleness=2", "rollout.num_servers=1",
        "rollout.health_interval_s=1", "trainer.total_steps=100000", "checkpoint.every_steps=0",
        "cluster.replan_every_steps=4", "cluster.autoscale=true", "cluster.autoscale_max_nodes=2",
        f"cluster.allocation_profile={ROLLOUT_BOUND}",
    )  # fmt: skip
    try:
        wait_for_steps(run_dir, 1, proc)  # controller.log exists from here on
        wait_for_log(run_dir, r"server 1 joins the job at ", proc, timeout_s=900)
        assert json.loads((run_dir / "scale.json").read_text()) == {"num_servers": 2}
        joined = wait_for_log(run_dir, r"servers \[1\] rejoin at version (\d+)", proc)
        wait_for_steps(run_dir, len(ledger(run_dir)) + 3, proc)  # the new server takes part
        # draining it shows what it served (autoscale may ask for it again afterwards: not checked)
        scale(run_dir, "-1")
        drained = wait_for_log(run_dir, r"server 1 drained after (\d+) requests", proc)
        os.kill(json.loads((run_dir / "pids.json").read_text())["trainer"], signal.SIGUSR1)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=120)
    assert int(drained.group(1)) > 0, "the server autoscale added never served a request"
    assert "autoscale: 1 -> 2 rollout servers" in out and "generation is the bottleneck" in out
    plans = check_replans(run_dir, 4, record_property)
    grown = [r for r in plans if r.get("plan/autoscale_target_nodes") == 2.0]
    assert grown and grown[0]["plan/autoscale_gain"] >= 1.1
    # until the pool grew, the job was one server and one trainer rank
    assert all(r["plan/current_rollout_fraction"] == 0.5 for r in plans if r["step"] <= grown[0]["step"])
    rows = ledger(run_dir)
    samples = [s for r in rows for s in r["samples"]]
    assert len(samples) == len(set(samples))  # none trained twice while the pool changed
    record_property("autoscale_step", int(grown[0]["step"]))
    print(f"\nautoscale added server 1 at step {int(grown[0]['step'])}; it served from version "
          f"{joined.group(1)} and answered {drained.group(1)} requests")  # fmt: skip
