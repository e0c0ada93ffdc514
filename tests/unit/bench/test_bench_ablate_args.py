"""`python -m bench.ablate`: each command's defaults, the plan's order (seed-major: a part cut
short holds whole pairs), the launch command of one run, and the per-run flock."""

import fcntl

import pytest

from bench.ablate import estimated_hours, launch_cmd, parse_args, plan, run_name
from bench.harness import held_flock


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
