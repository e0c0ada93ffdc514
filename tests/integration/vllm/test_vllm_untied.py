"""Broadcast into a real vLLM server holding an *untied* model (its own lm_head): greedy output
afterwards equals the trainer's. The tied case is in test_vllm_rollout.py; vLLM's CPU kernels
pre-pack the embedding and every linear layer, and the two cases reload through different layers.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_vllm_rollout import assert_greedy_equal, perturbed, publish
from vllm_harness import start_vllm

from tests.integration.engine_parity import prompts, trainer

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def untied_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with lm_head untied from the embedding (and different from it)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("untied-model")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model.config.tie_word_embeddings = False
    torch.manual_seed(3)
    head = model.model.embed_tokens.weight.detach().clone()
    model.lm_head.weight = torch.nn.Parameter(head + 0.02 * torch.randn_like(head))
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tiny_model_dir / name).read_bytes())
    return out


@pytest.fixture(scope="module")
def untied_server(untied_model_dir, tmp_path_factory):
    server = start_vllm(untied_model_dir, tmp_path_factory.mktemp("vllm-untied") / "server.log")
    yield server
    server.stop()


def test_untied_broadcast_makes_server_greedy_equal_trainer_greedy(untied_server, untied_model_dir):
    backend = trainer(untied_model_dir)
    assert "lm_head.weight" in dict(backend.iter_weights())  # untied: the head is sent too
    assert_greedy_equal(untied_server, backend, prompts(untied_model_dir, 2), version=0)
    backend = perturbed(untied_model_dir, seed=1)
    asyncio.run(publish(untied_server, dict(backend.iter_weights()), 1))
    assert_greedy_equal(untied_server, backend, prompts(untied_model_dir, 4), version=1)
