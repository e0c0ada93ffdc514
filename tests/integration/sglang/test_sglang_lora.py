"""LoRA against the session's real SGLang server on CPU: model.lora.ship=merged (base + B·A·scale,
broadcast as full weights) matches the trainer's LoRA model as tightly as full weights do.
(ship=adapter is refused for SGLang on CPU: tests/unit/rollout/test_rollout_lora.py.)

Leaves the server on the original weights (version 42), as the other modules expect.
"""

from __future__ import annotations

import asyncio

import pytest
from sglang_harness import Broadcaster

from areal_jobs.api import GenerateRequest
from areal_jobs.config import LoraConfig
from tests.integration.engine_parity import assert_parity, prompts, server_trainer_gap, trainer

pytestmark = pytest.mark.sglang

LORA = LoraConfig(rank=8, alpha=16.0)


def test_merged_lora_broadcast_logprobs_match_the_trainer(sglang_server, tiny_model_dir, record_property):
    backend = trainer(tiny_model_dir, LORA, adapter_seed=11)
    original = dict(trainer(tiny_model_dir).iter_weights())
    inputs = prompts(tiny_model_dir, 8)

    async def go():
        caster = Broadcaster(sglang_server)
        try:
            await caster.publish(dict(backend.iter_weights()), version=41)
            responses = await asyncio.gather(
                *(
                    caster.client.generate(GenerateRequest(f"lora{i}", ids, 48, 1.0))
                    for i, ids in enumerate(inputs)
                )
            )
            await caster.publish(original, version=42)  # back to the base for the other modules
            return responses
        finally:
            await caster.close()

    responses = asyncio.run(go())
    diff = server_trainer_gap(backend.model, inputs, responses)
    record_property("lora_merged_logprob_max_abs_diff", float(diff.max()))
    print(
        f"\nSGLang LoRA merged: |server - trainer| over {diff.size} tokens: max {diff.max():.2e}, mean {diff.mean():.2e}"
    )
    assert all(r.weight_version == 41 for r in responses)
    assert_parity(diff)
