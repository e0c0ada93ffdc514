"""In-process drivers for the real weight-update handshake against a real vLLM server: the same
orchestrator and broadcast group as tests/integration/sglang, over a VLLMClient."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from areal_jobs.config import ModelConfig, PauseMode, RolloutConfig, RolloutEngine
from areal_jobs.rollout.server import ServerProcess, start_server
from areal_jobs.rollout.vllm_client import VLLMClient
from areal_jobs.rollout.vllm_server import VENV_PYTHON
from areal_jobs.transport.discovery import free_port
from tests.integration.sglang.sglang_harness import Broadcaster as _Broadcaster


def client_for(server) -> VLLMClient:
    return VLLMClient("0", server.url, server.api_key, generate_timeout_s=300, call_timeout_s=120)


class Broadcaster(_Broadcaster):
    """The SGLang tests' Broadcaster with a vLLM client (the orchestrator does not know which)."""

    def __init__(self, server, bucket_bytes: int = 64 << 10, pause_mode: PauseMode = PauseMode.abort) -> None:
        super().__init__(server, bucket_bytes)
        self.client = client_for(server)
        self.pool.slots[0].client = self.client
        self.orch.pause_mode = pause_mode


def start_vllm(model_dir: Path, log: Path, model: ModelConfig | None = None) -> ServerProcess:
    """`model`: its lora slice decides the LoRA flags (model.lora.ship=adapter)."""
    if not VENV_PYTHON.exists():
        pytest.fail(f"{VENV_PYTHON} is missing: run `make vllm-venv` (make test does)")
    rollout = RolloutConfig(engine=RolloutEngine.vllm, kv_cache_gib=0.25)
    server = start_server(
        str(model_dir), "127.0.0.1", free_port(), secrets.token_hex(8), rollout, model or ModelConfig(), log,
        seed=0,
    )  # fmt: skip
    try:
        server.wait_healthy(timeout_s=600)
    except Exception:
        server.stop()
        raise RuntimeError(f"vLLM did not start; last log lines:\n{log.read_text()[-3000:]}") from None
    return server
