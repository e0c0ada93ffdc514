"""`python -m launch.simulate faults | replan` end to end on a small profile: the files it writes and
the numbers in its table against the fault model's hand-checked closed form."""

from __future__ import annotations

import json

import pytest
from test_launch_simulate import SMALL  # the small 8-node profile the simulator tests use

from launch.planning.reports.simulate import main
from launch.planning.sim.engine import run_async
from launch.planning.sim.faults import FaultModel, compare
from launch.planning.sim.profile import load_profile


def test_faults_report(tmp_path, capsys):
    out = tmp_path / "faults"
    rc = main(["faults", "--mtbf-h", "1000", "--requeue-wait-s", "900", "--out", str(out), *SMALL])
    assert rc == 0
    assert {p.name for p in out.iterdir()} == {"faults.md", "faults.json", "faults.png"}
    [row] = json.loads((out / "faults.json").read_text())
    p = load_profile("paper_1p5b", SMALL)
    r = run_async(p)
    expected = compare(
        FaultModel(gpu_mtbf_h=1000, requeue_wait_s=900, checkpoint_interval_s=50 * r.step_s),
        rollout_gpus=48,
        trainer_gpus=16,
        gpus_per_server=1,
        gpus_per_node=8,
        tokens_per_s=r.tokens_per_s,
        step_s=r.step_s,
    )
    assert row["outcome"]["tokens_per_s_healing"] == pytest.approx(expected.tokens_per_s_healing)
    assert row["outcome"]["job_interruptions_per_day_requeue"] == pytest.approx(64 * 24 / 1000)
    assert "| 1,000 | 900 |" in capsys.readouterr().out


def test_replan_report(tmp_path, capsys):
    out = tmp_path / "replan"
    rc = main(["replan", "--factors", "1,4,4", "--total-steps", "30", "--out", str(out), *SMALL])
    assert rc == 0
    assert {p.name for p in out.iterdir()} == {"replan.md", "replan.json", "replan.png"}
    windows = json.loads((out / "replan.json").read_text())
    assert [w["factor"] for w in windows] == [1.0, 4.0, 4.0]
    assert "3 windows of 10 steps" in capsys.readouterr().out


def test_bad_input_exits_2(capsys):
    assert main(["faults", "--restartable-share", "2", *SMALL]) == 2
    assert "restartable_share" in capsys.readouterr().err
