"""Rollout routing replay in the torch trainer's forward (trainer/forward/routing_replay.py) on a tiny
random Qwen3-MoE: the gather and renormalisation, the packed row's alignment, gradients, and the
refusals of trainer.routing_replay=rollout where it cannot work."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from areal_jobs.config import (
    JobConfig,
    RolloutConfig,
    RolloutEngine,
    RoutingReplay,
    TrainerBackend,
    TrainerConfig,
)
from areal_jobs.trainer.forward.hf_logprobs import token_logprobs
from areal_jobs.trainer.forward.routing_replay import replay_topk, replayed_routes, routers
from tests.unit.trainer import test_trainer_router_loss as moe
from tests.unit.trainer.test_trainer_torch_backend import make_batch

make_backend = moe.make_backend
tiny_moe_dir = moe.tiny_moe_dir  # the module-scoped fixture: a tiny random Qwen3-MoE on disk


def own_routes(model, sample) -> np.ndarray:
    """The model's own top-k [p + n, layers, top_k] for one sample, uint8."""
    seen = {}
    handles = [
        g.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o[2])) for i, g in routers(model)
    ]
    with torch.no_grad():
        model(input_ids=torch.from_numpy(sample.input_ids)[None], use_cache=False)
    for h in handles:
        h.remove()
    return np.stack([seen[i].numpy() for i in sorted(seen)], axis=1).astype(np.uint8)


def test_replaying_the_routers_own_choice_reproduces_its_output_exactly(tiny_moe_dir):
    gate = routers(make_backend(tiny_moe_dir).model)[0][1]
    x = torch.randn(7, gate.hidden_dim)
    logits, scores, indices = gate(x)
    got_scores, got_indices = replay_topk(
        logits, indices, indices.flip(-1), gate.num_experts, gate.norm_topk_prob
    )
    order = indices.flip(-1)  # the same experts in another order: the same weights, reordered
    assert torch.equal(got_indices, order) and torch.equal(got_scores, scores.flip(-1))


def test_replayed_experts_get_the_routers_renormalised_probabilities_and_gradients():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.5, 3.0, 1.0]], requires_grad=True)
    own = torch.topk(logits.detach(), 2).indices
    replayed = torch.tensor([[3, 2], [255, 255]])  # row 1: no route (all ones) -> its own top-k
    scores, indices = replay_topk(logits, own, replayed, num_experts=4, norm_topk_prob=True)
    probs = torch.softmax(logits.detach(), -1)
    assert indices.tolist() == [[3, 2], own[1].tolist()]
    expected = probs[0, [3, 2]] / probs[0, [3, 2]].sum()
    torch.testing.assert_close(scores[0], expected)
    torch.testing.assert_close(scores[1], probs[1, own[1]] / probs[1, own[1]].sum())
    unnormalised, _ = replay_topk(logits, own, replayed, num_experts=4, norm_topk_prob=False)
    torch.testing.assert_close(unnormalised[0], probs[0, [3, 2]])
    scores[0, 0].backward()  # the router still learns: d weight / d logits of the replayed row
    assert logits.grad[0].abs().sum() > 0 and logits.grad[1].abs().sum() == 0
    with pytest.raises(ValueError, match="routing_replay=off"):
        replay_topk(logits, own, torch.zeros(2, 3, dtype=torch.long), 4, True)


def test_packed_replay_aligns_each_samples_routes_with_its_tokens(tiny_moe_dir):
    """Own routes replayed: the log-probs are the plain forward's (bit for bit). Other experts at
    one position of one sample: that sample's later log-probs move, every other sample's stay."""
    model = make_backend(tiny_moe_dir).model.eval()
    samples = make_batch(n=4).samples
    own = [own_routes(model, s) for s in samples]
    with torch.no_grad():
        plain = token_logprobs(model, samples)
        replay = token_logprobs(
            model, [dataclasses.replace(s, routes=r) for s, r in zip(samples, own)], replay=True
        )
        for a, b in zip(plain, replay, strict=True):
            assert torch.equal(a, b)
        forced = [r.copy() for r in own]
        p = samples[2].num_prompt_tokens
        forced[2][p - 1] = (forced[2][p - 1] + 1) % 4  # other experts where its first output is predicted
        forced[1][:] = 255  # a sample without routes routes itself
        moved = token_logprobs(
            model, [dataclasses.replace(s, routes=r) for s, r in zip(samples, forced)], replay=True
        )
        not_asked = token_logprobs(model, [dataclasses.replace(s, routes=r) for s, r in zip(samples, forced)])
    for i in (0, 1, 3):
        assert torch.equal(moved[i], plain[i])
    assert (moved[2] - plain[2]).abs()[0] > 1e-4
    for a, b in zip(not_asked, plain, strict=True):  # routes present but replay off: no change
        assert torch.equal(a, b)


def test_replay_trains_the_router(tiny_moe_dir):
    model = make_backend(tiny_moe_dir).model
    s = make_batch(n=1).samples[0]
    routed = dataclasses.replace(s, routes=(own_routes(model, s) + 1) % 4)  # every position re-routed
    token_logprobs(model, [routed], replay=True)[0].sum().backward()
    for _, gate in routers(model):
        assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0


def test_a_dense_model_has_nothing_to_replay_into(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    with pytest.raises(ValueError, match="trainer.routing_replay=off"):
        with replayed_routes(dense, np.zeros((3, 2, 2), np.uint8)):
            pass
    with pytest.raises(ValueError, match="is dense.*trainer.routing_replay=off"):
        make_backend(tiny_model_dir, routing_replay=RoutingReplay.rollout)


def test_every_backend_takes_the_knob_and_the_engine_must_report_routes():
    for backend in TrainerBackend:  # every backend takes it (megatron/routing_replay.py, the torch hook)
        assert (
            TrainerConfig(backend=backend, routing_replay=RoutingReplay.rollout).routing_replay
            is RoutingReplay.rollout
        )
    with pytest.raises(ValueError, match="rollout/engine=vllm or trainer.routing_replay=off"):
        JobConfig(trainer=TrainerConfig(routing_replay=RoutingReplay.rollout))
    ok = JobConfig(
        trainer=TrainerConfig(routing_replay=RoutingReplay.rollout),
        rollout=RolloutConfig(engine=RolloutEngine.vllm),
    )
    assert ok.trainer.routing_replay is RoutingReplay.rollout
    assert TrainerConfig().routing_replay is RoutingReplay.off


def test_a_train_step_replays_and_reports_the_share_it_replayed(tiny_moe_dir):
    backend = make_backend(tiny_moe_dir, routing_replay=RoutingReplay.rollout)
    batch = make_batch(n=4)
    own = [own_routes(backend.model, s) for s in batch.samples]
    for r in own:
        r[-1] = 255  # as the engine reports: the last token was never an input
    batch.samples = [dataclasses.replace(s, routes=r) for s, r in zip(batch.samples, own)]
    batch.samples[3] = dataclasses.replace(batch.samples[3], routes=None)  # one sample without routes
    metrics = backend.train_step(batch)
    outputs = [s.num_output_tokens for s in batch.samples]
    assert metrics["train/routing_replay_token_fraction"] == pytest.approx(sum(outputs[:3]) / sum(outputs))
    assert np.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    assert "train/routing_replay_token_fraction" not in make_backend(tiny_moe_dir).train_step(make_batch(n=2))
