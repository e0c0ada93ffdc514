"""Chaos on the built-in task: kill -9 one rollout server mid-run, then the other inside a weight
broadcast, later kill -9 the trainer, restart, resume and finish. The ledger proves exactly the expected samples were trained (none
lost, none twice) and no trained token exceeded the staleness bound, before or after the restart.
Recovery times are printed (and recorded as test properties) for the closing note.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from .test_e2e_local import REPO, assert_every_sample_trained_once, ledger, start_local, wait_for_steps

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

ETA, B, G = 2, 2, 2
UPDATE_DONE = re.compile(r"version \d+ on the servers")
INJECT = Path(__file__).resolve().parent / "inject"  # kills a server inside an update, once armed
# the first attempt is cut short by the faults (it reached step 456 of 500 once: three server
# start-ups on a loaded machine), the resumed one extends to ckpt + 3
LONG_RUN = 100_000


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def updates_done(run_dir) -> int:
    """Weight updates the controller finished (it logs each one after the servers hold it)."""
    log = (run_dir / "logs" / "controller.log").read_bytes().decode(errors="replace")
    return len(UPDATE_DONE.findall(log))


def hold_trainer_between_updates(run_dir, trainer_pid: int, proc, attempts: int = 20) -> None:
    """SIGSTOP the trainer right after an update finished; return once no update is in flight.

    The trainer only asks for an update after a whole train step, so a stop within milliseconds
    of the "version N on the servers" line lands between two updates. Checked: if another update
    finishes while the trainer is held, one was in flight; resume it and try the next gap."""
    for _ in range(attempts):
        before = updates_done(run_dir)
        deadline = time.monotonic() + 300
        while updates_done(run_dir) == before:
            assert time.monotonic() < deadline, "no weight update finished in 300 s"
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.005)
        os.kill(trainer_pid, signal.SIGSTOP)
        held = updates_done(run_dir)
        time.sleep(1.0)
        if updates_done(run_dir) == held:
            return
        os.kill(trainer_pid, signal.SIGCONT)
    raise AssertionError(f"no gap between weight updates found in {attempts} tries")


def test_kill_server_then_trainer_resume_and_finish(tmp_path, tiny_model_dir, record_property):
    run_dir = tmp_path / "chaos"
    args = (
        f"algo.max_staleness={ETA}",
        "checkpoint.every_steps=2",
        "rollout.num_servers=2",
        "rollout.health_interval_s=1",
        "weight_sync.bucket_bytes=1048576",  # the tiny model in 4 buckets: fault 1b dies at bucket 2
    )
    # fault 1b's injection (inject/sitecustomize.py), armed later by writing this file
    arm = tmp_path / "kill-in-update.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(INJECT), str(REPO)]),
        "AREAL_TEST_KILL_IN_UPDATE": str(arm),
    }
    proc = start_local(tmp_path, tiny_model_dir, "chaos", *args, f"trainer.total_steps={LONG_RUN}", env=env)
    wait_for_steps(run_dir, 2, proc)

    # fault 1: kill -9 a whole SGLang server (its process group) in the middle of the run, while
    # it generates. A server that dies inside a weight broadcast ends the run instead (documented in
    # docs/faults.md; fault 2 covers that restart): CI once killed it in that window and the run
    # rightly exited 1. The trainer is held between two updates for the kill, so the case is fixed.
    victim = json.loads((run_dir / "servers" / "0.json").read_text())
    trainer_pid = json.loads((run_dir / "pids.json").read_text())["trainer"]
    hold_trainer_between_updates(run_dir, trainer_pid, proc)
    t_kill = time.monotonic()
    try:
        os.killpg(victim["pid"], signal.SIGKILL)
    finally:
        os.kill(trainer_pid, signal.SIGCONT)
    deadline = time.monotonic() + 600
    while "servers [0] rejoin" not in (run_dir / "logs" / "controller.log").read_text():
        assert time.monotonic() < deadline, "the restarted server never rejoined"
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    server_recovery_s = time.monotonic() - t_kill
    assert json.loads((run_dir / "servers" / "0.json").read_text())["pid"] != victim["pid"]

    # fault 1b: kill -9 the other server inside a weight broadcast (bucket 2 of 4): it leaves the
    # pool, the trainer sends that version again to the survivor, and the run goes on
    victim = json.loads((run_dir / "servers" / "1.json").read_text())
    arm.write_text(json.dumps({"server": 1, "pid": victim["pid"], "at_bucket": 2}))
    t_kill = time.monotonic()
    deadline = time.monotonic() + 600
    while "servers [1] rejoin" not in (run_dir / "logs" / "controller.log").read_bytes().decode(
        errors="replace"
    ):
        assert time.monotonic() < deadline, "the server killed inside an update never rejoined"
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    mid_update_recovery_s = time.monotonic() - t_kill
    fired = json.loads(arm.with_name(arm.name + ".fired").read_text())
    log = (run_dir / "logs" / "controller.log").read_bytes().decode(errors="replace")
    assert f"servers [1] died during the update to version {fired['version']}" in log
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert f"servers [1] died during the update to version {fired['version']}" in trainer_log
    steps_before = sum('"train/version"' in x for x in (run_dir / "metrics.jsonl").read_text().splitlines())

    # fault 2: kill -9 the trainer after a checkpoint exists; the launcher stops everything
    wait_for_steps(run_dir, steps_before + 2, proc)  # the rejoined server took part in an update
    pids = json.loads((run_dir / "pids.json").read_text())
    os.kill(pids["trainer"], signal.SIGKILL)
    assert proc.wait(timeout=300) == 1
    for pid in pids.values():
        assert not alive(pid), f"process {pid} outlived the failed run"
    checkpoint_step = json.loads(
        (
            run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip() / "meta.json"
        ).read_text()
    )["step"]

    # restart with the same command: resumes from the checkpoint and finishes
    STEPS = checkpoint_step + 3
    t_restart = time.monotonic()
    resumed = start_local(tmp_path, tiny_model_dir, "chaos", *args, f"trainer.total_steps={STEPS}")
    deadline = time.monotonic() + 900
    # The trainer truncates ledger.jsonl to the checkpoint before it logs the resume, so once the
    # log says so, any row past the checkpoint is new. Not "the last row is checkpoint_step + 1":
    # the restored untrained groups can train two steps within one poll (CI saw exactly that).
    while not (
        "resumed from checkpoint" in (run_dir / "logs" / "trainer.log").read_text()
        and max((r["step"] for r in ledger(run_dir)), default=0) > checkpoint_step
    ):
        assert time.monotonic() < deadline and resumed.poll() is None, resumed.stdout.read()[-3000:]
        time.sleep(0.2)
    trainer_recovery_s = time.monotonic() - t_restart
    assert resumed.wait(timeout=900) == 0, resumed.stdout.read()[-3000:]

    summary = assert_every_sample_trained_once(run_dir, STEPS, B, G, ETA)
    assert summary["resumed"]
    record_property("server_recovery_s", round(server_recovery_s, 1))
    record_property("trainer_recovery_s", round(trainer_recovery_s, 1))
    record_property("mid_update_recovery_s", round(mid_update_recovery_s, 1))
    print(f"\nserver kill -> rejoined with current weights: {server_recovery_s:.1f}s; "
          f"server kill inside update {fired['version']} -> retried without it, rejoined: {mid_update_recovery_s:.1f}s; "
          f"trainer kill -> restarted run trained step {checkpoint_step + 1}: {trainer_recovery_s:.1f}s "
          f"(resumed from checkpoint step {checkpoint_step})")  # fmt: skip
