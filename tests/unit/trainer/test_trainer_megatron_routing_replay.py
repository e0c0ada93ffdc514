"""Routing replay in Megatron's router (trainer/megatron/routing_replay.py), on CPU without ranks:
the replay slot inside Megatron-Core's own top-k routing gives the torch trainer's weights and
experts, positions without routes keep their own, and the routes are packed as the tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

from areal_jobs.api import TrainSample
from areal_jobs.config import RoutingReplay, TrainerBackend, TrainerConfig
from areal_jobs.trainer.forward.routing_replay import replay_token_fraction, replay_topk
from areal_jobs.trainer.megatron.routing_replay import ReplayedTopk, for_model, packed_routes

NO_ROUTE = 255


def megatron_routing(logits, table, *, pre_softmax: bool):
    """Megatron-Core 0.16's top-k softmax routing with our slot: (probs [T, E], map [T, E])."""
    slot = ReplayedTopk(layer=0)
    slot.table = table
    return topk_routing_with_score_function(logits, 2, use_pre_softmax=pre_softmax, router_replay=slot)


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_megatron_routing_with_replay_gives_the_torch_hooks_weights(pre_softmax):
    """pre_softmax=False is HF norm_topk_prob (softmax over the k logits = renormalised probs)."""
    torch.manual_seed(0)
    logits = torch.randn(5, 4, requires_grad=True)
    table = torch.tensor([[3, 2], [NO_ROUTE] * 2, [0, 1], [1, 0], [NO_ROUTE] * 2])
    probs, routing_map = megatron_routing(logits, table, pre_softmax=pre_softmax)
    own = torch.topk(logits.detach(), 2).indices
    scores, indices = replay_topk(logits, own, table, num_experts=4, norm_topk_prob=not pre_softmax)
    expected = torch.zeros(5, 4).scatter(1, indices, scores.detach())
    torch.testing.assert_close(probs.detach(), expected)
    assert torch.equal(routing_map, expected > 0)
    assert torch.equal(routing_map[1], torch.zeros(4).scatter(0, own[1], 1).bool())  # routed itself
    probs[0, 3].backward()  # the router keeps its gradient through the replayed weights
    assert logits.grad[0].abs().sum() > 0 and logits.grad[1].abs().sum() == 0


def test_without_a_table_the_slot_is_megatrons_own_top_k():
    logits = torch.randn(6, 4)
    plain = topk_routing_with_score_function(logits, 2, use_pre_softmax=False)
    for a, b in zip(megatron_routing(logits, None, pre_softmax=False), plain, strict=True):
        assert torch.equal(a, b)


def test_routes_of_another_shape_are_refused():
    with pytest.raises(ValueError, match="routing_replay=off"):
        megatron_routing(torch.randn(3, 4), torch.zeros(3, 3, dtype=torch.long), pre_softmax=False)
    with pytest.raises(ValueError, match="routing_replay=off"):  # a row of another length
        megatron_routing(torch.randn(3, 4), torch.zeros(4, 2, dtype=torch.long), pre_softmax=False)


def test_routes_are_packed_as_the_tokens_and_the_share_is_counted():
    a = np.arange(12, dtype=np.uint8).reshape(3, 2, 2) % 4
    b = None  # no routes: its rows route themselves
    c = np.full((4, 2, 2), 1, np.uint8)
    c[-1] = NO_ROUTE  # the last token: never an input
    row = packed_routes([a, b, c], [3, 2, 4], device=None)
    assert row.dtype == torch.int64 and tuple(row.shape) == (9, 2, 2)
    assert np.array_equal(row[:3].numpy(), a) and bool((row[3:5] == NO_ROUTE).all())
    assert np.array_equal(row[5:].numpy(), c)
    assert packed_routes([None, None], [3, 2], device=None) is None

    def sample(routes, p, n):
        return TrainSample(
            "",
            np.zeros(p + n, np.int64),
            p,
            np.zeros(n, np.float32),
            np.zeros(n, np.int32),
            0,
            0,
            routes=routes,
        )

    # a: 1 output token, predicted at position 1 (routed); c: 2 outputs at positions 1, 2 (routed)
    assert replay_token_fraction([sample(a, 2, 1), sample(b, 1, 1), sample(c, 2, 2)]) == pytest.approx(3 / 4)


def test_a_recomputed_layer_replays_the_row_its_forward_had():
    """trainer.recompute=full with pipeline stages: 1F1B runs micro-batch 1's forward before
    micro-batch 0's backward recomputes; the recompute must still see micro-batch 0's routes."""
    slot = ReplayedTopk(layer=0)
    slot.recomputed = True
    logits = torch.zeros(1, 4)
    rows = [torch.tensor([[0, 1]]), torch.tensor([[2, 3]])]
    chosen = []
    for row in rows:  # the checkpointed forwards, without grad
        slot.table = row
        with torch.no_grad():
            chosen.append(slot.get_replay_topk(logits, 2, default_compute_topk=megatron_topk)[1])
    for _ in rows:  # the backwards' recomputes, in the forwards' order, while the last row is set
        chosen.append(slot.get_replay_topk(logits, 2, default_compute_topk=megatron_topk)[1])
    assert [c.tolist() for c in chosen] == [[[0, 1]], [[2, 3]], [[0, 1]], [[2, 3]]]
    assert not slot.pending


def megatron_topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_replay_is_refused_for_a_dense_model():
    cfg = TrainerConfig(backend=TrainerBackend.megatron, routing_replay=RoutingReplay.rollout)
    assert (
        for_model(TrainerConfig(backend=TrainerBackend.megatron), False, torch.nn.Linear(1, 1), "m") is None
    )
    with pytest.raises(ValueError, match="dense.*trainer.routing_replay=off"):
        for_model(cfg, False, torch.nn.Linear(1, 1), "m")
