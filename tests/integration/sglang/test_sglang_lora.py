"""LoRA against the session's real SGLang server on CPU: model.lora.ship=merged (base + B·A·scale,
broadcast as full weights) matches the trainer's LoRA model as tightly as full weights do.
(ship=adapter is refused for SGLang on CPU: tests/unit/rollout/test_rollout_lora.py.)

Leaves the server on the original weights (version 42), as the other modules expect.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from sglang_harness import Broadcaster
from test_sglang_rollout import prompts

from areal_jobs.api import GenerateRequest
from areal_jobs.config import AlgoConfig, DType, LoraConfig, TrainerConfig
from areal_jobs.trainer import lora
from areal_jobs.trainer.batch import TrainSample
from areal_jobs.trainer.torch_backend import TorchBackend, token_logprobs

pytestmark = pytest.mark.sglang

LORA = LoraConfig(rank=8, alpha=16.0)


def test_merged_lora_broadcast_logprobs_match_the_trainer(sglang_server, tiny_model_dir, record_property):
    backend = TorchBackend(TrainerConfig(), AlgoConfig(), str(tiny_model_dir), DType.float32, LORA)
    backend.setup()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for layer in lora.lora_layers(backend.model):
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen) * 0.05)
    backend.model.eval()
    original = _base_weights(tiny_model_dir)
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
    samples = [
        TrainSample(
            f"s{i}",
            np.array(p + r.output_ids),
            len(p),
            np.array(r.logprobs, dtype=np.float32),
            np.zeros(len(r.output_ids), dtype=np.int32),
            0.0,
            0.0,
        )  # fmt: skip
        for i, (p, r) in enumerate(zip(inputs, responses))
        if r.output_ids
    ]
    with torch.no_grad():
        recomputed = torch.cat(token_logprobs(backend.model, samples)).numpy()
    diff = np.abs(recomputed - np.concatenate([s.behav_logprobs for s in samples]))
    record_property("lora_merged_logprob_max_abs_diff", float(diff.max()))
    print(
        f"\nSGLang LoRA merged: |server - trainer| over {diff.size} tokens: max {diff.max():.2e}, mean {diff.mean():.2e}"
    )
    assert all(r.weight_version == 41 for r in responses)
    assert diff.size > 50 and diff.mean() < 1e-3 and diff.max() < 1e-2


def _base_weights(model_dir):
    backend = TorchBackend(TrainerConfig(), AlgoConfig(), str(model_dir), DType.float32)
    backend.setup()
    return dict(backend.iter_weights())
