"""The rollout pool of a running job grows and shrinks (`python -m launch.scale`, what `make scale`
runs) on the built-in task with real SGLang servers: a server added mid-run joins at a weight update
(the current weights before its first request) and then serves requests; draining it lets its
requests in flight finish before its process is stopped. The ledger proves no sample was lost or
trained twice and every trained token stayed within the staleness bound.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from .test_e2e_local import REPO, ledger, start_local, wait_for_steps

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

ETA, B, G = 2, 2, 2
LONG_RUN = 100_000  # stopped by SIGUSR1 once the pool grew and shrank


def scale(run_dir, change: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "launch.scale", str(run_dir), change],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def wait_for_log(run_dir, pattern: str, proc, timeout_s: float = 600) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while True:
        log = (run_dir / "logs" / "controller.log").read_bytes().decode(errors="replace")
        found = re.search(pattern, log)
        if found:
            return found
        assert time.monotonic() < deadline, f"{pattern!r} not in controller.log after {timeout_s:.0f}s"
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)


def test_pool_grows_and_shrinks_mid_run(tmp_path, tiny_model_dir, record_property):
    run_dir = tmp_path / "elastic"
    proc = start_local(
        tmp_path, tiny_model_dir, "elastic", f"algo.max_staleness={ETA}", "rollout.num_servers=1",
        "rollout.health_interval_s=1", f"trainer.total_steps={LONG_RUN}", "checkpoint.every_steps=0",
    )  # fmt: skip
    try:
        wait_for_steps(run_dir, 2, proc)
        t_add = time.monotonic()
        assert scale(run_dir, "+1") == {"run_dir": str(run_dir), "num_servers_before": 1, "num_servers": 2}
        wait_for_log(run_dir, r"server 1 joins the job at ", proc)
        joined = wait_for_log(run_dir, r"servers \[1\] rejoin at version (\d+)", proc)
        join_s = time.monotonic() - t_add
        assert json.loads((run_dir / "pids.json").read_text())["server1"] > 0
        steps = len(ledger(run_dir))
        wait_for_steps(run_dir, steps + 3, proc)  # the new server takes part in generation

        t_drain = time.monotonic()
        scale(run_dir, "-1")
        drained = wait_for_log(run_dir, r"server 1 drained after (\d+) requests", proc)
        assert int(drained.group(1)) > 0, "the added server never served a request"
        deadline = time.monotonic() + 120
        while (run_dir / "servers" / "1.json").exists() or "server1" in json.loads(
            (run_dir / "pids.json").read_text()
        ):
            assert time.monotonic() < deadline, "the drained server was not released"
            time.sleep(0.5)
        drain_s = time.monotonic() - t_drain
        steps = len(ledger(run_dir))
        wait_for_steps(run_dir, steps + 2, proc)  # the run goes on with one server
        os.kill(json.loads((run_dir / "pids.json").read_text())["trainer"], signal.SIGUSR1)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=120)
    assert proc.returncode == 3, out[-3000:]  # checkpointed and stopped (launch.local: preempted)
    rows = ledger(run_dir)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    samples = [s for r in rows for s in r["samples"]]
    assert len(samples) == len(set(samples)) == len(rows) * B * G  # none lost, none twice
    assert all(r["trained_at_version"] - r["oldest_version"] <= ETA for r in rows)
    record_property("server_join_s", round(join_s, 1))
    record_property("server_drain_s", round(drain_s, 1))
    print(
        f"\nserver added -> serving from version {joined.group(1)} after {join_s:.1f}s; "
        f"drained after {drained.group(1)} requests and released in {drain_s:.1f}s; {len(rows)} steps"
    )
