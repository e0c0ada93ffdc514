"""bench/__main__.run_sections hands each section the servers it shares, without starting any:
--quick gives engine and weight_delta one vLLM server (started once, by the first to ask, and
stopped after weight_delta), and on a machine whose cores equal the shared SGLang server's
threads gives e2e that server with a `release` that stops it; the full bench does neither."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest

import bench.__main__ as bench_main
import bench.harness as harness
from bench.weights import weight_delta_bench


class FakeServer:
    def __init__(self, kind: str, log: list[str]) -> None:
        self.kind, self.log = kind, log
        log.append(f"start {kind}")

    def wait_healthy(self, timeout_s: float) -> None:
        pass

    def stop(self) -> None:
        self.log.append(f"stop {self.kind}")


@pytest.fixture
def sections(monkeypatch, tmp_path):
    log: list[str] = []

    @contextlib.contextmanager
    def sglang_server(model_dir, threads, log_dir):
        server = FakeServer("sglang", log)
        try:
            yield server
        finally:
            server.stop()

    monkeypatch.setattr(harness, "sglang_server", sglang_server)
    monkeypatch.setattr(harness, "bench_model", lambda: "model")
    monkeypatch.setattr(weight_delta_bench, "start_bf16_server", lambda *a: FakeServer("vllm", log))
    names = [(name, shared) for name, _, shared in bench_main.SECTIONS]
    for name, _ in names:
        module = types.ModuleType(f"fake_{name}")

        def run(quick, name=name, **kwargs):
            log.append(f"{name} {sorted(kwargs)}")
            if "vllm" in kwargs:
                kwargs["vllm"].get()
            if "release" in kwargs:
                kwargs["release"]()
                log.append(f"{name} released")
            return {}

        module.run = run
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(bench_main, "SECTIONS", [(n, f"fake_{n}", s) for n, s in names])
    monkeypatch.setattr(bench_main, "LOG_DIR", tmp_path)
    return log


def test_quick_on_2_cores_shares_one_vllm_and_hands_e2e_the_sglang_server(sections, monkeypatch):
    monkeypatch.setattr(bench_main.os, "cpu_count", lambda: bench_main.SHARED_SERVER_THREADS)
    results = bench_main.run_sections([n for n, _, _ in bench_main.SECTIONS], quick=True)
    assert results["errors"] == {}
    log = sections
    assert log.count("start sglang") == log.count("stop sglang") == 1
    assert log.count("start vllm") == log.count("stop vllm") == 1
    assert "engine ['server', 'vllm']" in log and "weight_delta ['vllm']" in log
    assert log.index("start vllm") > log.index("engine ['server', 'vllm']")
    assert log.index("stop vllm") > log.index("weight_delta ['vllm']")
    # e2e frees the server itself, before its own runs; nothing after it gets a server
    assert "e2e ['release', 'server']" in log
    assert log.index("stop sglang") == log.index("e2e ['release', 'server']") + 1
    after = log[log.index("e2e released") + 1 :]
    assert after and all(entry.endswith("[]") for entry in after), after


@pytest.mark.parametrize("quick, cpus", [(False, 2), (True, 4)])
def test_e2e_starts_its_own_servers_in_the_full_bench_or_beyond_2_cores(sections, monkeypatch, quick, cpus):
    """Beyond the shared server's threads the colocated run's own server has more; the full bench
    keeps every section's own servers (vLLM included) so its figures do not change."""
    monkeypatch.setattr(bench_main.os, "cpu_count", lambda: cpus)
    bench_main.run_sections([n for n, _, _ in bench_main.SECTIONS], quick=quick)
    log = sections
    assert ("start vllm" in log) is quick and ("engine ['server', 'vllm']" in log) is quick
    assert "e2e []" in log and log.index("stop sglang") < log.index("e2e []")
