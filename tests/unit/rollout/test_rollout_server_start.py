"""A starting server is waited for while it makes progress, not for a fixed time (server.py
`wait_healthy`): real processes stand in for the server, a real HTTP server answers /health."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from areal_jobs.rollout.server import ServerProcess
from areal_jobs.transport.discovery import free_port

# slow to start: works (CPU and log lines) for `work_s`, then answers GET /health with 200
SLOW_START = textwrap.dedent(
    """
    import http.server, sys, time
    port, work_s = int(sys.argv[1]), float(sys.argv[2])
    start = last = time.monotonic()
    while time.monotonic() - start < work_s:
        if time.monotonic() - last > 0.2:
            print("loading weights ...", flush=True)
            last = time.monotonic()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()

        def log_message(self, *args):
            pass

    print("ready", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)
# stuck: one log line, then nothing and no CPU (a hung file system, a deadlock)
STUCK = "import time; print('loading shard 3 of 8', flush=True); time.sleep(3600)"


def start(code: str, log: Path, *args: str) -> ServerProcess:
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(port), *args], stdout=out, stderr=subprocess.STDOUT
        )
    return ServerProcess("127.0.0.1", port, "key", proc, log_path=log)


def stop(server: ServerProcess) -> None:
    server.process.kill()
    server.process.wait(timeout=30)


def test_a_server_that_keeps_working_is_waited_for_past_the_no_progress_bound(tmp_path):
    """Six seconds of start-up against a 2.5 s no-progress bound: waited for, because it shows
    progress all along (CPU and a log line every 0.2 s of it)."""
    server = start(SLOW_START, tmp_path / "server.log", "6")
    try:
        server.wait_healthy(timeout_s=2.5, deadline_s=300)
        assert "ready" in (tmp_path / "server.log").read_text()
    finally:
        stop(server)


def test_a_server_without_progress_is_given_up_on_naming_what_was_waited_for(tmp_path):
    server = start(STUCK, tmp_path / "server.log")
    try:
        with pytest.raises(TimeoutError) as info:
            server.wait_healthy(timeout_s=2.0, deadline_s=300)
    finally:
        stop(server)
    message = str(info.value)
    for part in (
        "waited for GET /health to answer 200 (last: connection refused",
        "no progress for",
        "rollout.server_start_timeout_s=2",
        "last log line: 'loading shard 3 of 8'",
        f"pid {server.process.pid}",
    ):
        assert part in message, message


def test_the_deadline_bounds_a_start_that_never_ends(tmp_path):
    server = start(SLOW_START, tmp_path / "server.log", "3600")
    try:
        with pytest.raises(TimeoutError, match="start-up deadline of 3s reached"):
            server.wait_healthy(timeout_s=60.0, deadline_s=3)
    finally:
        stop(server)


def test_a_server_that_exits_while_starting_says_so(tmp_path):
    server = start("import sys; print('CUDA out of memory', flush=True); sys.exit(3)", tmp_path / "s.log")
    with pytest.raises(
        RuntimeError, match=r"exited with code 3 while starting; last log line: 'CUDA out of memory'"
    ):
        server.wait_healthy(timeout_s=60.0, deadline_s=300)
