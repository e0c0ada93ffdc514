"""A real SGLang server (CPU engine) on 127.0.0.1 for the session, started with an API key."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from areal_jobs.config import ModelConfig, RolloutConfig
from areal_jobs.rollout.server import ServerProcess, start_server
from areal_jobs.transport.discovery import free_port


@pytest.fixture(scope="session")
def sglang_server(tiny_model_dir: Path, tmp_path_factory) -> ServerProcess:
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    rollout = RolloutConfig(max_total_tokens=8192)
    server = start_server(
        str(tiny_model_dir),
        "127.0.0.1",
        free_port(),
        secrets.token_hex(8),
        rollout,
        ModelConfig(),
        log,
        seed=0,
    )
    try:
        server.wait_healthy(timeout_s=600)
    except Exception:
        server.stop()
        raise RuntimeError(f"SGLang did not start; last log lines:\n{log.read_text()[-3000:]}") from None
    yield server
    server.stop()
    assert server.process.poll() is not None
