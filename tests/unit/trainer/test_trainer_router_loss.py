"""The torch backend on a tiny random Qwen3-MoE: packed log-probs, the router's balancing loss."""

import dataclasses

import numpy as np
import pytest
import torch

from areal_jobs.config import AlgoConfig, DType, TrainerConfig
from areal_jobs.trainer.forward.hf_logprobs import token_logprobs
from areal_jobs.trainer.objective.router_loss import RouterLoss
from areal_jobs.trainer.torch.backend import TorchBackend
from tests.unit.trainer.test_trainer_torch_backend import make_batch


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = Qwen3MoeConfig(
            vocab_size=200, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=128, tie_word_embeddings=True, router_aux_loss_coef=0.01,
        )  # fmt: skip
        model = Qwen3MoeForCausalLM(config)
        with torch.no_grad():  # a router that prefers some experts: the balancing loss has work to do
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, 0.5)
        path = tmp_path_factory.mktemp("tiny-moe")
        model.save_pretrained(str(path))
    return path


def make_backend(path, **trainer):
    cfg = TrainerConfig(**{"max_tokens_per_microbatch": 64, "lr": 1e-3, **trainer})
    backend = TorchBackend(cfg, AlgoConfig(), str(path), DType.float32)
    backend.setup()
    return backend


def test_packed_moe_logprobs_equal_separate_forwards(tiny_moe_dir):
    """Routing is per token: packing sequences into one row changes no token's experts."""
    backend = make_backend(tiny_moe_dir)
    batch = make_batch()
    with torch.no_grad():
        packed = token_logprobs(backend.model, batch.samples)
        for s, lp in zip(batch.samples, packed, strict=True):
            torch.testing.assert_close(lp, token_logprobs(backend.model, [s])[0], atol=2e-5, rtol=0)


def test_balancing_loss_of_packed_row_equals_padded_batch_with_mask(tiny_moe_dir):
    """The padding-free row's loss (no mask: every row is a token) is the padded batch's with its
    attention mask excluding the padding, and differs from the padded batch's without one."""
    backend = make_backend(tiny_moe_dir)
    samples = make_batch().samples
    router = RouterLoss(0.0)
    with torch.no_grad():
        token_logprobs(backend.model, samples, router=router)
        packed = router.losses.pop()
        width = max(len(s.input_ids) for s in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(samples):
            ids[r, : len(s.input_ids)], mask[r, : len(s.input_ids)] = torch.from_numpy(s.input_ids), 1
        sdpa = type(backend.model).from_pretrained(str(tiny_moe_dir), attn_implementation="sdpa")
        padded = sdpa(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
        unmasked = sdpa(input_ids=ids, output_router_logits=True).aux_loss
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    assert abs(float(unmasked) - float(packed)) > 1e-3
    assert 2.0 <= float(packed) <= 4.0  # top-2 of 4: 2 when even, 4 when two experts take everything


def test_train_step_adds_the_weighted_balancing_loss_and_logs_it(tiny_moe_dir):
    # zero advantages: the policy loss has no gradient, only the balancing loss reaches the routers
    batch = make_batch()
    batch = dataclasses.replace(batch, samples=[dataclasses.replace(s, advantage=0.0) for s in batch.samples])
    # one micro-batch (each micro-batch's routing counts are its own), no clipping
    backend = make_backend(
        tiny_moe_dir, router_aux_loss_coef=0.5, max_tokens_per_microbatch=4096, grad_clip=1e9
    )
    gate = backend.model.model.layers[0].mlp.gate.weight
    router = RouterLoss(0.0)
    token_logprobs(backend.model, batch.samples, router=router)
    expected_loss = router.losses.pop()
    expected_loss.backward()
    expected_grad = gate.grad.clone()
    backend.model.zero_grad(set_to_none=True)
    metrics = backend.train_step(batch)
    assert metrics["train/router_aux_loss"] == pytest.approx(float(expected_loss.detach()), abs=1e-5)
    torch.testing.assert_close(gate.grad, 0.5 * expected_grad, atol=1e-6, rtol=1e-4)
    assert float(expected_grad.abs().max()) > 1e-4
    # the default weight is the model config's; 0 logs the loss and leaves the router alone
    default = make_backend(tiny_moe_dir)
    assert default.train_step(batch)["train/router_aux_loss_coef"] == pytest.approx(0.01)
    off = make_backend(tiny_moe_dir, router_aux_loss_coef=0.0)
    gate = off.model.model.layers[0].mlp.gate.weight.detach().clone()
    metrics = off.train_step(batch)
    assert np.isfinite(metrics["train/router_aux_loss"]) and metrics["train/router_aux_loss_coef"] == 0.0
    torch.testing.assert_close(off.model.model.layers[0].mlp.gate.weight.detach(), gate, atol=0, rtol=0)


def test_router_weight_for_a_dense_model_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="trainer.router_aux_loss_coef"):
        make_backend(tiny_model_dir, router_aux_loss_coef=0.1)
    assert "train/router_aux_loss" not in make_backend(tiny_model_dir).train_step(make_batch())
    with pytest.raises(ValueError, match="trainer.router_aux_loss_coef must be >= 0"):
        TrainerConfig(router_aux_loss_coef=-1.0)


def test_experts_leave_the_trainer_under_the_checkpoints_names(tiny_moe_dir):
    """transformers 5 fuses a layer's experts in memory; the engines load them per expert, as saved."""
    from safetensors.torch import load_file

    saved = load_file(str(tiny_moe_dir / "model.safetensors"))
    backend = make_backend(tiny_moe_dir)
    exported = dict(backend.iter_weights())
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in exported
    assert sorted(exported) == sorted(saved) == sorted(s.name for s in backend.weight_specs())
    for name, tensor in saved.items():
        torch.testing.assert_close(exported[name], tensor, atol=0, rtol=0)
