"""bench.harness.SharedServer: the server `python -m bench --quick` shares between sections is
started once, by the first section that asks, and stopped once (closing again is a no-op)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.harness import SharedServer


class FakeServer:
    def __init__(self, healthy: bool = True) -> None:
        self.healthy, self.waited, self.stopped = healthy, 0, 0

    def wait_healthy(self, timeout_s: float) -> None:
        self.waited += 1
        if not self.healthy:
            raise RuntimeError("exited with code 1 while starting")

    def stop(self) -> None:
        self.stopped += 1


def test_started_once_by_the_first_get_and_stopped_once(tmp_path):
    started: list[FakeServer] = []
    shared = SharedServer(lambda: started.append(FakeServer()) or started[-1], tmp_path / "x.log")
    shared.close()  # never started: nothing to stop
    assert started == []
    assert shared.get() is shared.get() is started[0]
    assert len(started) == 1 and started[0].waited == 1
    shared.close()
    shared.close()
    assert started[0].stopped == 1


def test_a_server_that_never_gets_healthy_is_stopped_and_its_log_quoted(tmp_path: Path):
    log = tmp_path / "vllm-bf16.log"
    log.write_text("ValueError: no CPU KV cache\n")
    server = FakeServer(healthy=False)
    shared = SharedServer(lambda: server, log)
    with pytest.raises(RuntimeError, match="no CPU KV cache"):
        shared.get()
    assert server.stopped == 1
    shared.close()
    assert server.stopped == 1
