"""The SLURM server task's restart policy (areal_jobs/rollout/supervise.py) with a stand-in server:
a small script whose exit codes are scripted. The whole path in a real SLURM job:
tests/integration/slurm/test_slurm_hetjob.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from areal_jobs.rollout.supervise import Supervisor, backoff_s

SCRIPT = """
import pathlib, sys
runs = pathlib.Path(sys.argv[1])
n = int(runs.read_text()) if runs.exists() else 0
runs.write_text(str(n + 1))
codes = [int(c) for c in sys.argv[2].split(",")]
sys.exit(codes[min(n, len(codes) - 1)])
"""


def scripted(tmp_path, codes: str) -> list[str]:
    return [sys.executable, "-c", SCRIPT, str(tmp_path / "runs"), codes]


def test_backoff_doubles_up_to_30_s():
    assert [backoff_s(n) for n in (1, 2, 3, 4, 5, 6, 7)] == [1, 2, 4, 8, 16, 30, 30]


def test_a_crashing_server_is_restarted_until_it_stops_cleanly(tmp_path):
    waits = []
    supervisor = Supervisor(scripted(tmp_path, "137,1,0"), max_restarts=3, sleep=waits.append)
    assert supervisor.run() == 0
    assert (tmp_path / "runs").read_text() == "3" and waits == [1.0, 2.0] and supervisor.restarts == 2


def test_the_budget_spent_it_gives_up_with_the_servers_code(tmp_path):
    waits = []
    supervisor = Supervisor(scripted(tmp_path, "3"), max_restarts=2, sleep=waits.append)
    assert supervisor.run() == 3
    assert (tmp_path / "runs").read_text() == "3" and waits == [1.0, 2.0]


def test_sigterm_stops_the_server_and_the_supervisor_exits_0(tmp_path):
    """As the job stops its servers: the TERM reaches the server, nothing is restarted."""
    ready = tmp_path / "server-up"
    child = (
        "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); "
        f"pathlib.Path({str(ready)!r}).touch(); time.sleep(600)"
    )
    code = (
        "import sys, signal; from areal_jobs.rollout.supervise import Supervisor; "
        f"s = Supervisor([sys.executable, '-c', {child!r}], max_restarts=5); "
        "signal.signal(signal.SIGTERM, s.on_sigterm); sys.exit(s.run())"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(600):  # the server is up, so the supervisor's handler is installed
            if ready.exists():
                break
            assert proc.poll() is None
            time.sleep(0.1)
        assert ready.exists(), "the stand-in server did not start within 60 s"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
