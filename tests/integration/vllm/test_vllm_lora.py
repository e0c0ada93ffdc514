"""LoRA against a real vLLM server on CPU started with LoRA enabled (model.lora.ship=adapter:
`--enable-lora`, VLLM_ALLOW_RUNTIME_LORA_UPDATING): after an adapter update the server's
log-probs match the trainer's LoRA model, each version replaces the last, a request held in place
finishes on the adapter it started with (its version, exactly), an aborted one goes on under the
new adapter, and ship=merged (a full broadcast of base + B·A·scale) matches too.

One server for the module (LoRA needs its own launch flags); the tests run in file order and each
says what it leaves on the server. Adapters are random (B ~ N(0, 0.05)), so every version is a
visibly different policy from the base and from each other.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import requests
from vllm_harness import Broadcaster, client_for, start_vllm

from areal_jobs.api import GenerateRequest
from areal_jobs.config import (
    AlgoConfig,
    DataConfig,
    LoraConfig,
    LoraShip,
    ModelConfig,
    PauseMode,
    RolloutConfig,
)
from areal_jobs.data.prompts import PromptStream, eval_prompts
from areal_jobs.data.tokenizer import load_tokenizer
from areal_jobs.rollout.controller import RolloutController
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.rollout.weight_update import WeightUpdateOrchestrator
from areal_jobs.trainer.torch.backend import TorchBackend
from areal_jobs.weights.buckets import tensor_bytes
from tests.integration.engine_parity import (
    ZeroScorer,
    assert_parity,
    hf_greedy,
    prompts,
    server_trainer_gap,
    trainer,
)

pytestmark = pytest.mark.vllm

LORA = LoraConfig(rank=8, alpha=16.0, ship=LoraShip.adapter)


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir: Path, tmp_path_factory):
    server = start_vllm(
        tiny_model_dir, tmp_path_factory.mktemp("vllm-lora") / "server.log", ModelConfig(lora=LORA)
    )
    yield server
    server.stop()


def policy(model_dir, seed: int) -> TorchBackend:
    """The torch trainer with LoRA and random adapters (a policy `seed` names)."""
    return trainer(model_dir, LORA, adapter_seed=seed)


class AdapterPublisher:
    """The controller's half of an adapter update on one server: pause, load, resume. Requests go
    through `client`, the one that loaded the adapters (it names the current one in each)."""

    def __init__(self, server, folder: Path, pause_mode: PauseMode = PauseMode.abort) -> None:
        self.pool = ServerPool()
        self.client = client_for(server)
        self.pool.add(0, self.client)
        self.orch = WeightUpdateOrchestrator(self.pool, pause_mode, step_timeout_s=120)
        self.folder = folder

    async def publish(self, backend: TorchBackend, version: int, on_paused=None) -> Path:
        path = self.folder / f"v{version}"
        backend.save_adapter(str(path))
        await self.orch.pause(lambda: self.pool.total_in_flight)
        if on_paused is not None:
            await on_paused()
        await self.orch.load_adapter(version, str(path))
        await self.orch.resume()
        return path

    async def generate(self, inputs, max_new_tokens, temperature, tag):
        return await asyncio.gather(
            *(
                self.client.generate(GenerateRequest(f"{tag}{i}", ids, max_new_tokens, temperature))
                for i, ids in enumerate(inputs)
            )
        )


def test_adapter_update_logprobs_match_the_trainer(lora_server, tiny_model_dir, tmp_path, record_property):
    """Leaves the server with adapter version 1 loaded (base weights untouched)."""
    backend = policy(tiny_model_dir, seed=1)
    inputs = prompts(tiny_model_dir, 8)

    async def go():
        publisher = AdapterPublisher(lora_server, tmp_path)
        try:
            path = await publisher.publish(backend, version=1)
            return path, await publisher.generate(inputs, 48, 1.0, "lp")
        finally:
            await publisher.client.close()

    path, responses = asyncio.run(go())
    gap = server_trainer_gap(backend.model, inputs, responses)
    base_gap = server_trainer_gap(trainer(tiny_model_dir).model, inputs, responses)
    adapter_bytes = (path / "adapter_model.safetensors").stat().st_size
    full_bytes = sum(tensor_bytes(s) for s in backend.weight_specs())
    record_property("lora_logprob_max_abs_diff", float(gap.max()))
    record_property("lora_logprob_mean_abs_diff", float(gap.mean()))
    record_property("adapter_bytes_per_update", adapter_bytes)
    record_property("full_bytes_per_update", full_bytes)
    print(
        f"\nvLLM LoRA adapter v1: |server - trainer| log-prob over {gap.size} tokens: max {gap.max():.2e}, "
        f"mean {gap.mean():.2e} (vs the base model: mean {base_gap.mean():.2e}); bytes per update: "
        f"adapter {adapter_bytes} vs full {full_bytes}"
    )
    assert all(r.weight_version == 1 for r in responses)
    assert_parity(gap)
    assert base_gap.mean() > 20 * max(gap.mean(), 1e-5)  # the server really generated with the adapter


def test_each_version_replaces_the_last(lora_server, tiny_model_dir, tmp_path):
    """Two versions in a row: greedy output is the newest adapter's (HF greedy of that policy), and
    the older adapter, idle, is unloaded. Leaves adapter version 3 loaded."""
    first, second = policy(tiny_model_dir, seed=2), policy(tiny_model_dir, seed=3)
    inputs = prompts(tiny_model_dir, 4)
    headers = {"Authorization": f"Bearer {lora_server.api_key}"}

    async def go():
        publisher = AdapterPublisher(lora_server, tmp_path)
        try:
            await publisher.publish(first, version=2)
            await publisher.publish(second, version=3)
            served = await publisher.generate(inputs, 24, 0.0, "g3-")
            return served, dict(publisher.client.adapters.loaded)
        finally:
            await publisher.client.close()

    served, loaded = asyncio.run(go())
    assert list(loaded.values()) == [3]  # version 2's adapter went as soon as it was idle
    models = requests.get(f"{lora_server.url}/v1/models", headers=headers, timeout=30).json()["data"]
    assert [m["id"] for m in models if m["id"].startswith("areal-v2-")] == []
    assert list(loaded)[0] in [m["id"] for m in models]
    for ids, response in zip(inputs, served):
        assert response.weight_version == 3
        assert response.output_ids == hf_greedy(second, ids, 24)


def test_held_request_finishes_on_its_own_adapter(lora_server, tiny_model_dir, tmp_path):
    """pause_mode=in_place: a request frozen while the next adapter (policy B) loads resumes on the
    adapter it was sent with (policy A), so its answer is exactly A's uninterrupted greedy answer
    and every token says A's version; the next request uses B. Leaves one adapter of B loaded."""
    policy_a, policy_b = policy(tiny_model_dir, seed=4), policy(tiny_model_dir, seed=5)
    candidates = prompts(tiny_model_dir, 16)
    max_new = 400

    async def go():
        publisher = AdapterPublisher(lora_server, tmp_path, PauseMode.in_place)
        client = publisher.client
        try:
            held, uninterrupted = [], None
            for attempt in range(5):  # vLLM is fast: retry until an update lands mid-answer
                version_a = 100 + 2 * attempt
                await publisher.publish(policy_a, version=version_a)
                if uninterrupted is None:
                    plain = await publisher.generate(candidates, max_new, 0.0, "long-")
                    index = max(range(len(plain)), key=lambda i: len(plain[i].output_ids))
                    uninterrupted = plain[index]
                    assert len(uninterrupted.output_ids) >= 100, "no long greedy answer to hold"
                name_a = client.adapters.current[0]
                running = asyncio.gather(
                    *(client.generate(GenerateRequest(f"hold{attempt}-{j}", candidates[index], max_new, 0.0))
                      for j in range(2))
                )  # fmt: skip
                await asyncio.sleep(0.05)

                async def count_held(name=name_a):
                    held.append(client.adapters.in_flight.get(name, 0))

                await publisher.publish(policy_b, version=version_a + 1, on_paused=count_held)
                answers = await running
                if held[-1]:
                    break
            after = await publisher.generate([candidates[0]], 24, 0.0, "after-")
            await publisher.publish(policy_b, version=1000)  # the held adapter is idle now: unloaded
            return uninterrupted, answers, held, after[0], dict(client.adapters.loaded), version_a
        finally:
            await client.close()

    uninterrupted, answers, held, after, loaded, version_a = asyncio.run(go())
    print(f"\nin_place adapter update: requests held per attempt {held}")
    assert held[-1] > 0, f"no update landed while a request ran ({held})"
    for answer in answers:
        assert answer.finish_reason.value != "abort"
        assert answer.weight_version == version_a  # the adapter it was sent with, for every token
        assert answer.output_ids == uninterrupted.output_ids
    assert after.weight_version == version_a + 1
    assert after.output_ids == hf_greedy(policy_b, candidates[0], 24)
    assert sorted(loaded.values()) == [1000]


def test_aborted_request_goes_on_under_the_new_adapter(lora_server, tiny_model_dir, tmp_path):
    """pause_mode=abort through the controller: the sample is interrupted, re-sent as prompt +
    partial output under the next adapter; each token keeps the version of the adapter it came
    from. The same adapter weights are published each time, so greedy continuation reproduces
    the uninterrupted answer exactly. Leaves the latest of those adapters loaded."""
    backend = policy(tiny_model_dir, seed=6)
    tok = load_tokenizer(tiny_model_dir)
    data = DataConfig(num_eval_prompts=16)
    candidates = eval_prompts(data, tok.encode)
    max_new = 400

    async def go():
        publisher = AdapterPublisher(lora_server, tmp_path, PauseMode.abort)
        await publisher.publish(backend, version=20)
        plain = await publisher.generate([p.input_ids for p in candidates], max_new, 1e-5, "ab-")
        index = max(range(len(plain)), key=lambda i: len(plain[i].output_ids))
        stream = PromptStream(data, tok.encode)
        stream.at = lambda i: dataclasses.replace(candidates[index], data_index=i)
        pushed, done = [], asyncio.Event()

        async def push(group):
            pushed.append(group)
            if any(s.num_interruptions for s in group.samples) or len(pushed) >= 6:
                done.set()

        rollout = RolloutConfig(
            max_new_tokens=max_new, temperature=1e-5, pause_mode=PauseMode.abort, max_concurrent=2
        )
        algo = AlgoConfig(batch_size=1, group_size=2, max_staleness=10_000)
        ctl = RolloutController(rollout, algo, publisher.pool, ZeroScorer(), stream, tok.decode, push)
        ctl.version = 20

        async def keep_updating():
            # a pause every second, at most 12: each one aborts what is in flight, so generation
            # must progress between them (back to back, 0.05 s apart, they starved it on a loaded
            # machine: no group finished in 600 s)
            version = 20
            while not done.is_set() and version < 32:
                ctl.running.clear()
                version += 1
                await publisher.publish(backend, version=version)
                ctl.on_version(version)
                ctl.running.set()
                await asyncio.sleep(1.0)

        updater = asyncio.create_task(keep_updating())
        admission = asyncio.create_task(ctl.admission_loop())
        try:
            await asyncio.wait_for(done.wait(), timeout=600)
        finally:
            done.set()
            await updater
            await ctl.stop()
            admission.cancel()
            await publisher.client.close()
        return pushed, plain[index]

    pushed, uninterrupted = asyncio.run(go())
    group = next((g for g in pushed if any(s.num_interruptions for s in g.samples)), None)
    assert group is not None, f"no group of {len(pushed)} was interrupted"
    assert any(len(set(s.versions.tolist())) >= 2 for s in group.samples)
    for sample in group.samples:
        versions = sample.versions.tolist()
        assert versions == sorted(versions) and versions[0] >= 20
        assert sample.output_ids.tolist() == uninterrupted.output_ids


def test_merged_ship_broadcast_matches_the_trainer(lora_server, tiny_model_dir, record_property):
    """ship=merged: base + B·A·scale broadcast as full weights (requests name no adapter).
    Leaves the server's base weights replaced by that merged policy (last test of the module)."""
    backend = policy(tiny_model_dir, seed=7)
    inputs = prompts(tiny_model_dir, 8)

    async def go():
        caster = Broadcaster(lora_server)
        try:
            await caster.publish(dict(backend.iter_weights()), version=30)
            return await asyncio.gather(
                *(
                    caster.client.generate(GenerateRequest(f"m{i}", ids, 48, 1.0))
                    for i, ids in enumerate(inputs)
                )
            )
        finally:
            await caster.close()

    responses = asyncio.run(go())
    gap = server_trainer_gap(backend.model, inputs, responses)
    record_property("merged_logprob_max_abs_diff", float(gap.max()))
    print(
        f"\nvLLM LoRA merged broadcast: |server - trainer| over {gap.size} tokens: max {gap.max():.2e}, mean {gap.mean():.2e}"
    )
    assert all(r.weight_version == 30 for r in responses)
    assert_parity(gap)
