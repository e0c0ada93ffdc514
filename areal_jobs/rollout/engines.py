"""Which client speaks to a rollout server of each engine (rollout/engine=sglang|vllm).

The controller and the weight-update orchestrator only ever see api.RolloutEngineClient; this is
the one place that maps the configured engine to its client class (launching is in server.py).
"""

from __future__ import annotations

from areal_jobs.api import RolloutEngineClient
from areal_jobs.config import ControlConfig, RolloutEngine
from areal_jobs.rollout.sglang_client import SGLangClient
from areal_jobs.rollout.vllm_client import VLLMClient
from areal_jobs.transport.retry import RetryPolicy

CLIENTS: dict[RolloutEngine, type] = {RolloutEngine.sglang: SGLangClient, RolloutEngine.vllm: VLLMClient}


def make_client(
    engine: RolloutEngine,
    name: str,
    url: str,
    api_key: str,
    *,
    generate_timeout_s: float,
    call_timeout_s: float,
    retry: RetryPolicy | None = None,
    load_deadline_s: float = 0.0,
    tp_size: int = 1,
    routes: bool = False,
) -> RolloutEngineClient:
    """`retry`: how safe control calls are repeated (None: each is tried once); weight loads from
    files repeat until `load_deadline_s` instead of the policy's deadline when that is longer.
    `tp_size`: the server's TP ranks (an SGLang encoded bucket carries one request per rank).
    `routes`: responses carry their expert routes (trainer.routing_replay=rollout; vLLM only)."""
    if routes and engine is not RolloutEngine.vllm:
        raise ValueError(
            f"rollout/engine={engine.value} reports no expert routes: set trainer.routing_replay=off"
        )
    extra = {"routes": True} if routes else {}
    return CLIENTS[engine](
        name, url, api_key, generate_timeout_s=generate_timeout_s, call_timeout_s=call_timeout_s,
        retry=retry, load_deadline_s=load_deadline_s, tp_size=tp_size, **extra,
    )  # fmt: skip


def control_retry(call_timeout_s: float, control: ControlConfig) -> RetryPolicy:
    """The job's policy for repeating safe server control calls (docs/faults.md)."""
    return RetryPolicy(
        first_timeout_s=call_timeout_s,
        deadline_s=max(control.call_deadline_s, call_timeout_s),
        backoff_s=control.backoff_s,
        max_backoff_s=control.max_backoff_s,
        max_timeout_s=max(control.call_deadline_s / 2, call_timeout_s),
    )
