"""Adapter shipping (model.lora.ship=adapter) on the rollout side: launch flags per engine, the
CPU refusal for SGLang, and which adapter (and version) a client's requests name."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from areal_jobs.api import FinishReason, GenerateRequest
from areal_jobs.config import JobConfig, LoraConfig, LoraShip, ModelConfig, RolloutEngine
from areal_jobs.rollout.lora_adapters import (
    AdapterSet,
    check_adapter_shipping,
    lora_server_args,
    lora_server_env,
)
from areal_jobs.rollout.sglang_client import SGLangClient
from areal_jobs.rollout.vllm_client import VLLMClient

ADAPTER = LoraConfig(rank=4, ship=LoraShip.adapter, target_modules=["q_proj", "v_proj"])


def test_sglang_on_cpu_refuses_adapter_shipping_by_name():
    JobConfig(model=ModelConfig(lora=ADAPTER))  # a valid config: the refusal depends on the device
    with pytest.raises(
        ValueError, match=r"model.lora.ship=adapter is not supported by SGLang on CPU.*ship=merged"
    ):
        check_adapter_shipping(RolloutEngine.sglang, ADAPTER, cpu=True)
    with pytest.raises(ValueError, match="not supported by SGLang on CPU"):
        lora_server_args(RolloutEngine.sglang, ADAPTER, cpu=True)
    check_adapter_shipping(RolloutEngine.vllm, ADAPTER, cpu=True)
    check_adapter_shipping(RolloutEngine.sglang, ADAPTER, cpu=False)


def test_launch_flags_per_engine():
    merged = LoraConfig(rank=4)
    for engine in RolloutEngine:  # ship=merged: the servers see a plain model
        assert lora_server_args(engine, merged, cpu=True) == [] and lora_server_env(engine, merged) == {}
    sglang = lora_server_args(RolloutEngine.sglang, ADAPTER, cpu=False)
    assert sglang == [
        "--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "q_proj", "v_proj",
        "--max-loras-per-batch", "5",
    ]  # fmt: skip
    vllm = lora_server_args(RolloutEngine.vllm, ADAPTER, cpu=True)
    assert vllm == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "4", "--max-cpu-loras", "4"]
    assert lora_server_env(RolloutEngine.vllm, ADAPTER) == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with pytest.raises(ValueError, match="above vLLM's largest"):
        lora_server_args(RolloutEngine.vllm, LoraConfig(rank=1024, ship=LoraShip.adapter), cpu=True)


def test_adapter_set_names_tracks_requests_and_finds_idle_adapters():
    adapters = AdapterSet()
    assert adapters.acquire() is None  # before the first update: the base weights
    first = adapters.new_name(3)
    adapters.loaded_as(first, 3)
    held = adapters.acquire()
    assert held == (first, 3)
    second = adapters.new_name(3)  # the same version published again gets a fresh name
    assert second != first
    adapters.loaded_as(second, 3)
    assert adapters.idle() == []  # the first is still in use by a request
    adapters.release(held)
    assert adapters.idle() == [first]
    adapters.unloaded(first)
    assert list(adapters.loaded) == [second] and not adapters.in_flight


class _Recorder:
    """Stands in for EngineHTTP: records what the client sends, answers like the engine."""

    def __init__(self, answer):
        self.calls, self.answer = [], answer

    async def generate(self, endpoint, body):
        self.calls.append((endpoint, body))
        return self.answer

    async def post(self, endpoint, body, timeout=None):
        self.calls.append((endpoint, body))
        return {"success": True}


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_requests_name_the_current_adapter_and_report_its_version(engine):
    if engine == "sglang":
        client = SGLangClient("0", "http://x", "k", generate_timeout_s=1, call_timeout_s=1)
        answer = {"output_ids": [5], "meta_info": {"output_token_logprobs": [[-0.5, 5, None]],
                                                    "finish_reason": {"type": "stop"}, "weight_version": "0"}}  # fmt: skip
        field, load, unload = "lora_path", "/load_lora_adapter", "/unload_lora_adapter"
    else:
        client = VLLMClient("0", "http://x", "k", generate_timeout_s=1, call_timeout_s=1)
        answer = {"choices": [{"token_ids": [5], "finish_reason": "stop", "weight_versions": [],
                               "logprobs": {"content": [{"token_id": 5, "logprob": -0.5}]}}]}  # fmt: skip
        field, load, unload = "model", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    client._http = recorder = _Recorder(answer)

    async def go():
        base = await client.generate(GenerateRequest("a", [1, 2], 4))
        await client.load_lora_adapter("/run/weights/lora/v7", 7)
        first = await client.generate(GenerateRequest("b", [1, 2], 4))
        await client.load_lora_adapter("/run/weights/lora/v8", 8)
        second = await client.generate(GenerateRequest("c", [1, 2], 4))
        return base, first, second, await client.weight_version()

    base, first, second, version = asyncio.run(go())
    sent = [body for endpoint, body in recorder.calls if endpoint.endswith("generate")]
    assert field not in sent[0] and base.weight_version == 0
    assert sent[1][field] == "areal-v7-1" and first.weight_version == 7
    assert sent[2][field] == "areal-v8-2" and second.weight_version == 8 and version == 8
    assert first.finish_reason is FinishReason.stop
    loads = [(e, b) for e, b in recorder.calls if e in (load, unload)]
    assert loads == [
        (load, {"lora_name": "areal-v7-1", "lora_path": "/run/weights/lora/v7"}),
        (load, {"lora_name": "areal-v8-2", "lora_path": "/run/weights/lora/v8"}),
        (unload, {"lora_name": "areal-v7-1"}),  # idle once the next one is loaded
    ]


class _AdapterServer:
    """Records the update calls a server gets; loads adapters."""

    def __init__(self) -> None:
        self.calls: list = []

    async def pause(self, mode):
        self.calls.append(("pause", mode))

    async def resume(self):
        self.calls.append(("resume",))

    async def load_lora_adapter(self, path, version):
        self.calls.append(("load", path, version))


def test_the_controller_loads_the_adapter_on_every_server_without_a_broadcast():
    """PauseRequest(adapter_path=...): pause, every server loads it, resume, VersionPublished;
    no group is formed and no bucket asked for (ControllerService with scripted servers)."""
    from areal_jobs.config import PauseMode
    from areal_jobs.rollout.server_pool import ServerPool
    from areal_jobs.rollout.service import ControllerService
    from areal_jobs.rollout.weight_update import WeightUpdateOrchestrator
    from areal_jobs.transport import messages as m

    from .test_rollout_update_retry import REQUEST, Channel, Controller

    servers = [_AdapterServer(), _AdapterServer()]
    pool = ServerPool()
    for i, s in enumerate(servers):
        pool.add(i, s)
    ctl, channel = Controller(), Channel()
    orch = WeightUpdateOrchestrator(pool, PauseMode.in_place, step_timeout_s=5.0)
    svc = ControllerService(ctl, pool, orch, channel, [], eval_every_steps=0, step_timeout_s=5.0)
    asyncio.run(svc._update_weights(dataclasses.replace(REQUEST, adapter_path="/run/weights/lora/v5")))
    paused, published = channel.sent
    assert paused == m.Paused(version=5, world_size=3, init_group=False, group_generation=0)
    assert isinstance(published, m.VersionPublished) and published.version == 5 and ctl.version == 5
    for server in servers:
        assert server.calls == [("pause", "in_place"), ("load", "/run/weights/lora/v5", 5), ("resume",)]
