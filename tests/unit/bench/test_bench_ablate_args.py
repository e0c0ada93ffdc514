"""`python -m bench.staleness.ablate`: each command's defaults, the plan's order (seed-major: a part cut
short holds whole pairs), the launch command of one run, and the per-run flock."""

import fcntl

import pytest

from bench.harness import held_flock
from bench.staleness.ablate import (
    REPO,
    estimated_hours,
    launch_cmd,
    parse_args,
    plan,
    run_name,
    shown_run_dir,
)


def test_command_defaults_and_overrides():
    args = parse_args(["calibrate"])
    assert args.arms == ["decoupled"] and args.delays == [0, 8, 16, 32] and args.lrs == [1.5e-4, 3e-4]
    assert "experiment=countdown" in args.overrides and "run.eval_every_steps=0" in args.overrides
    args = parse_args(["run", "--lr", "2e-3", "run.eval_every_steps=20"])
    assert args.arms == ["naive", "decoupled", "decoupled_nocap"] and args.delays == [0, 2, 4, 8]
    assert args.lrs == [2e-3] and "run.eval_every_steps=20" in args.overrides
    assert "run.eval_every_steps=0" not in args.overrides


@pytest.mark.parametrize(
    "bad", [["run", "trainer.lr=1"], ["run", "algo.exact_delay=3"], ["pilot", "--arms", "decoupled"]]
)
def test_the_varied_settings_are_refused_as_overrides(bad):
    with pytest.raises(SystemExit):
        parse_args(bad)


def test_plan_is_seed_major_and_pairs_arms():
    args = parse_args(["pilot", "--seeds", "1,2", "--delays", "8"])
    cells = plan(args)
    assert [(c["seed"], c["arm"]) for c in cells] == [
        (1, "naive"),
        (1, "decoupled"),
        (2, "naive"),
        (2, "decoupled"),
    ]
    cmd = launch_cmd(args, cells[1])
    assert "algo.exact_delay=8" in cmd and "algo.max_staleness=8" in cmd and "algo.behav_weight_cap=5" in cmd
    assert f"run.name={run_name(cells[1])}" in cmd and "trainer.seed=1" in cmd
    nocap = launch_cmd(parse_args(["run"]), {**cells[1], "arm": "decoupled_nocap"})
    assert "algo.behav_weight_cap=0" in nocap and "algo.decoupled=true" in nocap


def test_lock_is_held_during_a_run_and_released_after(tmp_path):
    lock = tmp_path / "heavy.lock"
    with held_flock(lock, 0.0), open(lock) as other:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again
    with held_flock(None, 0.0):
        pass


def test_run_plan_has_one_arm_at_delay_0_and_no_cap_at_the_largest_delay_only():
    args = parse_args(["run", "--seeds", "1"])
    by_delay = {}
    for c in plan(args):
        by_delay.setdefault(c["delay"], []).append(c["arm"])
    assert by_delay == {
        0: ["decoupled"],
        2: ["naive", "decoupled"],
        4: ["naive", "decoupled"],
        8: ["naive", "decoupled", "decoupled_nocap"],
    }
    every = parse_args(["run", "--seeds", "1", "--all-arms-at-0", "--nocap-delays", "4,8"])
    arms = [(c["delay"], c["arm"]) for c in plan(every)]
    assert arms[:3] == [(0, "naive"), (0, "decoupled"), (2, "naive")]  # no cap only at --nocap-delays
    assert (4, "decoupled_nocap") in arms and (2, "decoupled_nocap") not in arms
    # a naive-only plan keeps its reference run at delay 0
    assert [c["arm"] for c in plan(parse_args(["run", "--arms", "naive", "--delays", "0"]))][:1] == ["naive"]


def test_the_plan_states_its_hours():
    cells = plan(parse_args(["pilot"]))
    assert len(cells) == 6
    assert estimated_hours(cells) == pytest.approx(6 * (105 + 6.5 * 60) / 3600)


def test_records_name_run_directories_without_a_machines_absolute_path(tmp_path):
    """bench/staleness/results/ablation.json and calibration.json are committed: their run_dir must mean the same on
    every machine (relative to the repository, or <run-root's name>/<run> outside it)."""
    assert shown_run_dir(REPO / "runs" / "ablate" / "naive-x") == "runs/ablate/naive-x"
    assert shown_run_dir(tmp_path / "myruns" / "naive-x") == "myruns/naive-x"


def test_issue_42_arms_vary_the_prompt_order_with_the_seed_by_default():
    """New arms: data.seed = trainer.seed (run names -ds, records data_seed), naive beside them on
    the same seeds and order, and every new arm also at delay 0 (not PPO on fresh data); the old
    arms keep data.seed 1 and their run names, so --reuse finds the existing runs."""
    args = parse_args(["run", "--arms", "naive,icepop,m2po,m2po_areal,prime,cispo,decoupled_ess",
                       "--lr", "1.5e-4", "--delays", "0,8", "--seeds", "1,2,3"])  # fmt: skip
    assert args.data_seed_follows_seed is True
    cells = plan(args)
    assert len(cells) == 3 * 2 * 7
    zero = [c["arm"] for c in cells if c["seed"] == 1 and c["delay"] == 0]
    assert zero == ["naive", "icepop", "m2po", "m2po_areal", "prime", "cispo", "decoupled_ess"]
    m2po = next(c for c in cells if c["arm"] == "m2po" and c["seed"] == 2 and c["delay"] == 8)
    assert m2po["data_seed"] == 2 and run_name(m2po) == "m2po-lr0.00015-mb4-d8-s2-n60-ds"
    cmd = launch_cmd(args, m2po)
    assert "algo.objective=m2po" in cmd and "data.seed=2" in cmd and "trainer.seed=2" in cmd
    ess = launch_cmd(args, {**m2po, "arm": "decoupled_ess"})
    assert "algo.ess_step=sqrt" in ess and "algo.behav_weight_cap=5" in ess
    old = parse_args(["pilot"])
    assert old.data_seed_follows_seed is False
    assert all(c["data_seed"] is None and not run_name(c).endswith("-ds") for c in plan(old))
    assert not any(x.startswith("data.seed=") for x in launch_cmd(old, plan(old)[0]))
    # either way on request; and the objective keys are the ablation's own
    assert parse_args(["pilot", "--data-seed-follows-seed"]).data_seed_follows_seed is True
    assert (
        parse_args(["run", "--arms", "naive,cispo", "--no-data-seed-follows-seed"]).data_seed_follows_seed
        is False
    )
    for bad in (["run", "algo.objective=cispo"], ["run", "data.seed=3"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_outputs_and_figure_with_new_arms(tmp_path):
    """write_outputs and the figure on hand-made records with two issue-42 arms on seed-following
    prompts beside the old decoupled arm: the JSON pools per arm, the PNG is whole."""
    import json

    from bench.staleness.ablate import plot, write_outputs
    from bench.staleness.ablation_table import ablation_summary

    def rec(arm, seed, sampled, data_seed=None):
        return {"arm": arm, "lr": 1.5e-4, "minibatches": 4, "delay": 8, "seed": seed, "steps": 60,
                "data_seed": data_seed, "sampled_end": sampled, "greedy_end": sampled, "reward_auc": sampled,
                "preclip": 0.05, "preclip_cut": 0.02, "k3_kl": 0.03, "abs_log_w_p99": 1.0, "ess": 0.9,
                "clip_fraction": 0.04}  # fmt: skip

    runs = [rec("naive", 1, 0.5), rec("decoupled", 1, 0.2), rec("naive", 2, 0.45), rec("decoupled", 2, 0.25)]
    runs += [rec(a, s, x, data_seed=s) for a, s, x in
             [("naive", 1, 0.5), ("m2po", 1, 0.55), ("cispo", 1, 0.4), ("naive", 2, 0.4), ("m2po", 2, 0.5),
              ("cispo", 2, 0.35)]]  # fmt: skip
    args = parse_args(["run", "--arms", "naive,m2po,cispo", "--out", str(tmp_path), "--seeds", "1,2"])
    text = write_outputs(args, runs)
    data = json.loads((tmp_path / "ablation.json").read_text())
    assert data["settings"]["data_seed_follows_seed"] is True
    assert set(data["pooled"]) == {"decoupled", "m2po", "cispo"}
    assert data["pooled"]["m2po"]["8"]["sampled_end"]["mean"] == pytest.approx(0.075)
    assert "| 0.00015 | 4 | 8 | seed |" in text and "| cispo | 8 | 0.00015 | 2 | -0.075 [" in text
    png = plot(ablation_summary(runs), tmp_path / "ablation.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
