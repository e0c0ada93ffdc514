"""Routing replay on Megatron-Core (trainer.routing_replay=rollout, megatron/routing_replay.py).

A tiny random Qwen3-MoE (harness.make_tiny_hf "qwen3_moe": 4 experts, top-2, 2 layers), a batch
whose routes are random expert pairs (so they differ from the trainer's own choice at most
positions), one sample without routes and one whose prompt has none (a cached prefix), the last
row of each unreported as the engine sends it. At EP 1 (one rank), EP 2 x DP 2 (two ranks over
gloo; the routes reach rank 1 through the batch broadcast) and PP 2 with trainer.recompute=full
(each stage's router reads its own layer's routes; 1F1B recomputes a micro-batch's layers after
the next one's forward):
  - Megatron's log-probs with the replayed routes equal the torch trainer's with the same routes
    (trainer/forward/hf_logprobs.py, the torch hook), and differ from its own routing's;
  - positions without routes route themselves (that sample's logits are the unreplayed ones);
  - a train step equals the torch backend's step on the same batch (loss, updated weights: the
    routers' gradients flow through the replayed weights), logging the same
    train/routing_replay_token_fraction.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from harness import (
    exported,
    hf_state,
    make_batch,
    make_tiny_hf,
    run_ranks,
    start_backend,
    trainer_config,
    update_diff,
)

pytestmark = pytest.mark.megatron

LOGP_TOL = 1e-5  # fp32, the contract's METRIC_TOL (tests/integration/contract)
LOSS_TOL = 1e-6  # the contract's
UPDATE_TOL = 1e-3  # the contract's: ||after - torch's|| / ||torch's step||
NO_ROUTE = 255


def replay_batch():
    batch = make_batch(0)
    rng = np.random.default_rng(7)
    samples = []
    for i, s in enumerate(batch.samples):
        n = len(s.input_ids)
        routes = np.stack([np.stack([rng.permutation(4)[:2] for _ in range(2)]) for _ in range(n)]).astype(
            np.uint8
        )
        routes[-1] = NO_ROUTE  # the last token was never an input
        if i == 2:
            routes[: s.num_prompt_tokens - 1] = NO_ROUTE  # a prompt prefix served from the cache
        samples.append(dataclasses.replace(s, routes=None if i == 1 else routes))
    return dataclasses.replace(batch, samples=samples)


# layout -> (pp, dp = ep, trainer.recompute)
LAYOUTS = {"ep1": (1, 1, "none"), "ep2": (1, 2, "none"), "pp2_recompute": (2, 1, "full")}


def config(layout: str):
    from areal_jobs.config import Recompute, RoutingReplay

    pp, dp, recompute = LAYOUTS[layout]
    return trainer_config(
        1, pp, dp, ep_size=dp, router_aux_loss_coef=0.0, routing_replay=RoutingReplay.rollout,
        recompute=Recompute(recompute),
    )  # fmt: skip


def worker(rank: int, world: int, model: str, layout: str) -> dict:
    backend = start_backend(model, config(layout))
    batch = replay_batch()
    seqs = [s.input_ids for s in batch.samples]
    replayed = backend.full_logits(seqs, [s.routes for s in batch.samples])
    plain = backend.full_logits(seqs)
    metrics = backend.train_step(batch if rank == 0 else None)
    last = replayed is not None  # the last pipeline stage's ranks
    return {
        "replayed": replayed.numpy() if last else None,
        "plain": plain.numpy() if last else None,
        "metrics": metrics,
        "after": exported(backend),
    }


def output_logp(logits: np.ndarray, batch) -> list[np.ndarray]:
    """Per sample, the log-probs of its output tokens from the packed row's logits [T, V]."""
    out, start = [], 0
    for s in batch.samples:
        rows = logits[start : start + len(s.input_ids)].astype(np.float64)
        logp = rows - rows.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        p = s.num_prompt_tokens
        out.append(logp[np.arange(p - 1, len(s.input_ids) - 1), s.input_ids[p:]])
        start += len(s.input_ids)
    return out


def torch_logp(model_dir, batch, *, replay: bool) -> list[np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    from areal_jobs.trainer.forward.hf_logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return [t.numpy() for t in token_logprobs(model, batch.samples, replay=replay)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from harness import torch_backend_step

    model = make_tiny_hf(tmp_path_factory.mktemp("replay") / "qwen3_moe", "qwen3_moe", tied=True, seed=3)
    batch = replay_batch()
    torch_metrics, torch_after = torch_backend_step(model, batch, config("ep1"))
    out = {"model": model, "batch": batch, "torch": (torch_metrics, torch_after)}
    for layout, (pp, dp, _) in LAYOUTS.items():
        out[layout] = run_ranks(worker, pp * dp, str(model), layout, timeout_s=300)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_replays_the_routes_as_the_torch_trainer(runs, layout):
    batch = runs["batch"]
    want = torch_logp(runs["model"], batch, replay=True)
    own = torch_logp(runs["model"], batch, replay=False)
    for rank in (r for r in runs[layout] if r["replayed"] is not None):
        got = output_logp(rank["replayed"], batch)
        plain = output_logp(rank["plain"], batch)
        gap = max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))
        moved = max(float(np.abs(w - o).max()) for w, o in zip(want, own, strict=True))
        own_gap = max(float(np.abs(p - o).max()) for p, o in zip(plain, own, strict=True))
        print(
            f"\n{layout}: |megatron - torch| with replay {gap:.1e}, own routing {own_gap:.1e}; replay moved {moved:.1e}"
        )
        assert gap < LOGP_TOL and own_gap < LOGP_TOL
        assert moved > 1e-2  # the replayed routes are not the trainer's own choice
        # the sample without routes routes itself: bit for bit the unreplayed row's logits
        start = len(batch.samples[0].input_ids)
        rows = slice(start, start + len(batch.samples[1].input_ids))
        assert np.array_equal(rank["replayed"][rows], rank["plain"][rows])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_replayed_step_is_the_torch_backends(runs, layout):
    torch_metrics, torch_after = runs["torch"]
    before = hf_state(runs["model"])
    ranks = runs[layout]
    metrics = ranks[0]["metrics"]  # global rank 0 logs (the metrics are reduced onto it)
    after = {k: v for rank in ranks for k, v in rank["after"].items()}
    weights_max, update_rel = update_diff(after, torch_after, before)
    loss_gap = abs(metrics["train/loss"] - torch_metrics["train/loss"])
    fraction = metrics["train/routing_replay_token_fraction"]
    print(
        f"\n{layout}: loss gap {loss_gap:.1e}, weights max {weights_max:.1e}, update rel {update_rel:.1e}, replayed share {fraction:.3f}"
    )
    assert loss_gap < LOSS_TOL and update_rel < UPDATE_TOL
    assert fraction == torch_metrics["train/routing_replay_token_fraction"]
    assert 0.5 < fraction < 1.0  # one sample has no routes
    router = "model.layers.0.mlp.gate.weight"
    assert np.abs(after[router] - before[router]).max() > 0  # the router learns through replay
