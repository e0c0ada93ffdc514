"""bench.staleness.auto_eta: the commands it would run (arms paired by seed, overrides replacing defaults)
and its table from finished runs (written by hand here, no training)."""

from __future__ import annotations

import json

import pytest

from bench.staleness import auto_eta


def test_each_arm_is_one_launch_with_its_bound_and_the_seed_pairs_them():
    args = auto_eta.parse_args(["run", "--seeds", "4", "trainer.total_steps=5", "rollout.num_servers=2"])
    cmds = {arm: auto_eta.launch_cmd(arm, args, 4) for arm in args.arms}
    assert [c[c.index("-m") + 1] for c in cmds.values()] == ["launch.local"] * 4
    assert "algo.max_staleness=auto" in cmds["auto"] and "algo.max_staleness=8" in cmds["fixed8"]
    for cmd in cmds.values():
        assert {"trainer.seed=4", "data.seed=4", "experiment=countdown", "rollout.num_servers=2"} <= set(cmd)
        assert "trainer.total_steps=5" in cmd and "trainer.total_steps=60" not in cmd
    with pytest.raises(SystemExit):
        auto_eta.parse_args(["run", "--arms", "fixed4"])


def fake_run(root, arm, seed, sampled, wall, bounds):
    args = auto_eta.parse_args(["table", "--run-root", str(root)])
    run_dir = root / auto_eta.run_name(arm, args, seed)
    run_dir.mkdir(parents=True)
    summary = {"steps": 60, "wall_s": wall, "accuracy_end": sampled, "greedy_accuracy_end": sampled + 0.1}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    rows = [
        {"train/version": i + 1, "staleness/mean": b * 0.9, "staleness/bound": b}
        for i, b in enumerate(bounds)
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_the_table_pairs_auto_with_each_fixed_bound_by_seed(tmp_path, capsys):
    for seed, (a, f0, f8) in enumerate([(0.5, 0.55, 0.2), (0.45, 0.5, 0.3), (0.5, 0.52, 0.1)], start=1):
        fake_run(tmp_path, "auto", seed, a, 300.0, [8, 8, 3, 2, 2])
        fake_run(tmp_path, "fixed0", seed, f0, 500.0, [0] * 5)
        fake_run(tmp_path, "fixed8", seed, f8, 250.0, [8] * 5)
    out = tmp_path / "out"
    args = ["table", "--arms", "fixed0,fixed8,auto", "--run-root", str(tmp_path), "--out", str(out)]
    assert auto_eta.main(args) == 0
    summary = json.loads((out / "auto_eta.json").read_text())["summary"]
    assert summary["arms"]["auto"]["bound_mean"]["mean"] == pytest.approx(4.6)
    vs8 = summary["paired"]["fixed8"]["sampled_end"]
    assert vs8["diffs"] == pytest.approx([0.3, 0.15, 0.4]) and vs8["auto_higher"] == 3
    assert summary["paired"]["fixed0"]["wall_s"]["stat"]["mean"] == pytest.approx(-200.0)
    text = (out / "auto_eta.md").read_text()
    assert "| fixed8 | 3 | +0.283 [" in text and "(3/3)" in text
