"""In-process drivers for the real weight-update handshake against a real vLLM server: the same
orchestrator and broadcast group as tests/integration/sglang, over a VLLMClient."""

from __future__ import annotations

from areal_jobs.config import PauseMode
from areal_jobs.rollout.vllm_client import VLLMClient
from tests.integration.sglang.harness import Broadcaster as _Broadcaster


def client_for(server) -> VLLMClient:
    return VLLMClient("0", server.url, server.api_key, generate_timeout_s=300, call_timeout_s=120)


class Broadcaster(_Broadcaster):
    """The SGLang tests' Broadcaster with a vLLM client (the orchestrator does not know which)."""

    def __init__(self, server, bucket_bytes: int = 64 << 10, pause_mode: PauseMode = PauseMode.abort) -> None:
        super().__init__(server, bucket_bytes)
        self.client = client_for(server)
        self.pool.slots[0].client = self.client
        self.orch.pause_mode = pause_mode
