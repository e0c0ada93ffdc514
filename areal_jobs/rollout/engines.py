"""Which client speaks to a rollout server of each engine (rollout/engine=sglang|vllm).

The controller and the weight-update orchestrator only ever see api.RolloutEngineClient; this is
the one place that maps the configured engine to its client class (launching is in server.py).
"""

from __future__ import annotations

from areal_jobs.api import RolloutEngineClient
from areal_jobs.config import RolloutEngine
from areal_jobs.rollout.sglang_client import SGLangClient
from areal_jobs.rollout.vllm_client import VLLMClient

CLIENTS: dict[RolloutEngine, type] = {RolloutEngine.sglang: SGLangClient, RolloutEngine.vllm: VLLMClient}


def make_client(
    engine: RolloutEngine,
    name: str,
    url: str,
    api_key: str,
    *,
    generate_timeout_s: float,
    call_timeout_s: float,
    tp_size: int = 1,
) -> RolloutEngineClient:
    """`tp_size`: the server's TP ranks (an SGLang encoded bucket carries one request per rank)."""
    return CLIENTS[engine](
        name, url, api_key, generate_timeout_s=generate_timeout_s, call_timeout_s=call_timeout_s,
        tp_size=tp_size,
    )  # fmt: skip
