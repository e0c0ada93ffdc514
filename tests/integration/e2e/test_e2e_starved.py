"""A run that rides out a starved and stalling machine (issue 32): the built-in job, with first
timeouts far below what the machine can meet for a while, through three faults in turn:

1. every process of the run on 2% of one CPU for 40 s (a cgroup quota: starve.py), so control
   calls exceed their first timeouts and are repeated (reads) or waited for (state changes);
2. the rollout server stopped (SIGSTOP, 15 s) inside a weight update, just before
   begin_weight_update: the call goes unanswered, is waited for (never sent twice), and the
   update goes through once the server runs;
3. the trainer stopped (SIGSTOP, 15 s) inside its broadcast, while the server waits for it in the
   collective: the bucket stage times out with every server answering, so the controller sends the
   version again with doubled stage timeouts, and the trainer, once it runs, forms fresh groups.

The run finishes by itself, and the ledger proves every sample trained exactly once and the
staleness bound held. Faults 2 and 3 land where they do deterministically (inject/sitecustomize.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from areal_jobs.atomic import write_atomic

from .starve import CpuStarver
from .test_e2e_local import (
    REPO,
    assert_every_sample_trained_once,
    run_processes,
    start_local,
    wait_for_steps,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

ETA, B, G = 2, 2, 2
STEPS = 16
INJECT = Path(__file__).resolve().parent / "inject"
STALL_S = 15.0  # 30x the first call timeout, 7.5x the first stage timeout


def steps_done(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return sum('"train/version"' in x for x in metrics.read_text().splitlines()) if metrics.exists() else 0


def arm(path: Path, order: dict) -> None:
    """Arm a stall atomically: the hook never reads a half-written order."""
    write_atomic(path, json.dumps(order))


def fire(armed: Path, proc, timeout_s: float = 600) -> dict:
    """Wait until the run walked into an armed stall."""
    fired = armed.with_name(armed.name + ".fired")
    deadline = time.monotonic() + timeout_s
    while not fired.exists():
        assert time.monotonic() < deadline, f"{armed.name} never fired"
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    return json.loads(fired.read_text())


def test_a_starved_and_stalling_run_finishes_with_every_sample_trained_once(
    tmp_path, tiny_model_dir, record_property
):
    run_dir = tmp_path / "starved"
    stall_server, stall_trainer = tmp_path / "stall-server.json", tmp_path / "stall-trainer.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(INJECT), str(REPO)]),
        "AREAL_TEST_STALL_SERVER_IN_UPDATE": str(stall_server),
        "AREAL_TEST_STALL_TRAINER_IN_BROADCAST": str(stall_trainer),
    }
    proc = start_local(
        tmp_path, tiny_model_dir, "starved",
        f"algo.max_staleness={ETA}", f"trainer.total_steps={STEPS}", "checkpoint.every_steps=0",
        # first attempts far below what a starved machine meets: every fault below outlasts them
        "rollout.call_timeout_s=0.5", "weight_sync.step_timeout_s=2", "rollout.health_interval_s=1",
        env=env,
    )  # fmt: skip
    wait_for_steps(run_dir, 3, proc)

    # 1. a starved machine; fault 2 is armed before the starvation ends, so the run cannot finish
    # its last steps (seconds each, once it has the CPU again) before walking into it
    t0, before = time.monotonic(), steps_done(run_dir)
    server = json.loads((run_dir / "servers" / "0.json").read_text())
    with CpuStarver(lambda: run_processes(run_dir), share=0.02) as starver:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(1)
        arm(stall_server, {"pid": server["pid"]})
    starved_steps = steps_done(run_dir) - before
    print(f"\n40 s at 2% of a CPU ({starver.mechanism}): {starved_steps} steps")

    # 2. the server stops inside an update, before begin_weight_update
    fired = fire(stall_server, proc)
    server_version = fired["version"]
    # 3. armed while the server is stopped (no later version can be broadcast yet): the trainer
    # stops inside the broadcast of the next version
    arm(stall_trainer, {"after_version": server_version})
    time.sleep(STALL_S)
    os.killpg(server["pid"], signal.SIGCONT)

    trainer_pid = json.loads((run_dir / "pids.json").read_text())["trainer"]
    fired_trainer = fire(stall_trainer, proc)
    assert int(re.search(r"\(version (\d+)\)", fired_trainer["stage"]).group(1)) > server_version
    time.sleep(STALL_S)
    os.kill(trainer_pid, signal.SIGCONT)

    assert proc.wait(timeout=1200) == 0, proc.stdout.read()[-3000:]
    wall_s = time.monotonic() - t0
    controller = (run_dir / "logs" / "controller.log").read_bytes().decode(errors="replace")
    trainer = (run_dir / "logs" / "trainer.log").read_text()
    # 2: the unanswered begin was waited for (never sent twice: a late twin could open a session
    # after its end) until the server ran again, and the update went through
    assert "/begin_weight_update on server 0: no answer after" in controller, controller[-4000:]
    assert "/begin_weight_update on server 0: answered after" in controller
    assert f"version {server_version} on the servers" in controller
    assert "rollout server 0 marked down" not in controller  # slow, stalled, never taken for dead
    # 3: the bucket stage timed out with the server answering; the version went again, slower
    assert "with every server answering: sending it again with stage timeouts of 4s" in controller
    assert "with every server alive: sending it again with longer stage timeouts" in trainer
    repeats = controller.count(": attempt ") - controller.count("succeeded at attempt")
    waits = controller.count("still waiting for it")

    assert_every_sample_trained_once(run_dir, STEPS, B, G, ETA)
    record_property("starved_steps", starved_steps)
    record_property("repeated_calls", repeats)
    record_property("waited_calls", waits)
    record_property("wall_s", round(wall_s, 1))
    print(
        f"starved + server stall + trainer stall: {STEPS} steps, {STEPS * B * G} samples trained once "
        f"each, 0 lost; {repeats} control-call attempts repeated, {waits} waits past a first timeout; "
        f"{wall_s:.0f}s from the starvation to the end"
    )
