"""trainer=fsdp trains a mixture of experts as the torch backend does (issue 44, docs/moe.md).

A tiny random Qwen3-MoE (4 experts, top-2, attention biases, tied embeddings), the router's
load-balancing loss on (the model config's weight 0.01):
  - 1 rank at the default micro-batch budget (several micro-batches): the torch backend's step
    (loss, grad norm, updated weights, train/router_aux_loss) within the contract's bounds;
  - 2 gloo ranks at a budget where the torch backend packs the batch into exactly 2 micro-batches,
    the groups the DP plan gives the two ranks: the torch backend's step too; at the default
    budget the micro-batches differ and so does the loss's value, by design (trainer/fsdp/moe.py):
    the logged value is the token-weighted mean of the balancing losses of the plan's micro-batches;
  - the balancing loss moves the router (the same step with the weight 0 leaves it elsewhere);
  - the export has the checkpoint's per-expert names, the specs announce exactly what arrives,
    the initial export equals the checkpoint on disk and `save_hf` writes what the sender sends;
  - a sharded checkpoint restores every expert after another step moved them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fsdp_harness import (
    exported,
    make_batch,
    make_tiny_hf,
    max_abs_diff,
    megatron_harness,
    run_ranks,
    start_backend,
    trainer_config,
    update_diff,
)

# the backend contract's bounds (tests/integration/contract/test_backend_contract.py)
LOSS_TOL, GRAD_REL_TOL, WEIGHT_TOL, UPDATE_TOL = 1e-6, 1e-4, 3e-4, 1e-3
AUX_TOL = 1e-6  # train/router_aux_loss, of order 2
ROUTER = "model.layers.0.mlp.gate.weight"


def lengths_of(batch) -> list[int]:
    return [len(s.input_ids) for s in batch.samples]


def two_microbatch_budget(lengths: list[int]) -> int:
    """A budget under which the torch backend packs `lengths` into exactly the 2 groups the
    2-rank DP plan assigns to the ranks, one micro-batch each."""
    from areal_jobs.trainer.intake.dp_plan import plan_microbatches
    from areal_jobs.trainer.intake.packing import balanced_microbatches

    shares = balanced_microbatches(lengths, sum(lengths), min_count=2)
    budget = max(sum(lengths[i] for i in share) for share in shares)
    assert balanced_microbatches(lengths, budget) == shares
    assert plan_microbatches(lengths, 2, budget) == [[shares[0]], [shares[1]]]
    return budget


def step_worker(rank: int, world: int, model_dir: str, out: str, budget: int) -> dict:
    backend = start_backend(model_dir, trainer_config(world, max_tokens_per_microbatch=budget))
    specs = [(s.name, s.dtype, s.shape) for s in backend.weight_specs()]
    before = exported(backend)
    metrics = backend.train_step(make_batch(0) if rank == 0 else None)
    after = exported(backend)
    order = [name for name, _ in backend.iter_weights()]
    backend.save_hf(str(Path(out) / "hf"))
    backend.save_checkpoint(str(Path(out) / "ckpt"))
    backend.train_step(make_batch(1) if rank == 0 else None)  # moves every expert
    moved = exported(backend)
    backend.load_checkpoint(str(Path(out) / "ckpt"))
    restored = exported(backend)
    off = start_backend(
        model_dir, trainer_config(world, max_tokens_per_microbatch=budget, router_aux_loss_coef=0.0)
    )
    off.train_step(make_batch(0) if rank == 0 else None)
    default_budget = start_backend(model_dir, trainer_config(world))
    aux_default = default_budget.train_step(make_batch(0) if rank == 0 else None)["train/router_aux_loss"]
    return {
        "specs": specs, "order": order, "before": before, "metrics": metrics, "after": after,
        "moved": moved, "restored": restored, "off": exported(off), "aux_default_budget": aux_default,
    }  # fmt: skip


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return make_tiny_hf(tmp_path_factory.mktemp("fsdp_moe") / "qwen3_moe", "qwen3_moe", tied=True, seed=3)


def compare_with_torch(moe_dir: Path, lead: dict, budget: int) -> dict[str, float]:
    expected_metrics, expected = megatron_harness.torch_backend_step(
        moe_dir, make_batch(0), trainer_config(1, max_tokens_per_microbatch=budget)
    )
    weights, update = update_diff(lead["after"], expected, lead["before"])
    got = lead["metrics"]
    diffs = {
        "loss": abs(got["train/loss"] - expected_metrics["train/loss"]),
        "grad_norm_rel": abs(got["train/grad_norm"] / expected_metrics["train/grad_norm"] - 1),
        "weights_max": weights,
        "update_rel": update,
        "router_aux_loss": abs(got["train/router_aux_loss"] - expected_metrics["train/router_aux_loss"]),
    }
    print(f"\nvs torch (budget {budget}): " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    limits = [LOSS_TOL, GRAD_REL_TOL, WEIGHT_TOL, UPDATE_TOL, AUX_TOL]
    assert all(v < limit for v, limit in zip(diffs.values(), limits)), diffs
    assert got["train/router_aux_loss_coef"] == expected_metrics["train/router_aux_loss_coef"] == 0.01
    return expected_metrics


def check_export_and_checkpoint(moe_dir: Path, lead: dict, out: Path) -> None:
    assert lead["specs"] == [(k, "float32", lead["after"][k].shape) for k in lead["order"]]
    names = set(lead["after"])
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names and not any(
        "gate_up_proj" in k for k in names
    )
    on_disk = megatron_harness.hf_state(moe_dir)
    assert max_abs_diff(lead["before"], on_disk) == 0.0, "the initial export is the checkpoint, name for name"
    assert max_abs_diff(megatron_harness.hf_state(out / "hf"), lead["after"]) == 0.0
    assert max_abs_diff(lead["moved"], lead["after"]) > 0
    assert max_abs_diff(lead["restored"], lead["after"]) == 0.0, (
        "the sharded checkpoint restores every expert"
    )
    moved = float(np.abs(lead["after"][ROUTER] - lead["off"][ROUTER]).max())
    print(f"router moved by the balancing loss: {moved:.1e}")
    assert moved > 0, "router_aux_loss_coef=0.01 left the router where 0 put it"


def test_one_rank_trains_the_moe_as_the_torch_backend(moe_dir, tmp_path):
    (lead,) = run_ranks(step_worker, 1, str(moe_dir), str(tmp_path), 40)
    assert lead["metrics"]["train/num_microbatches"] > 1
    compare_with_torch(moe_dir, lead, 40)
    check_export_and_checkpoint(moe_dir, lead, tmp_path)


def test_two_ranks_train_the_moe_as_the_torch_backend(moe_dir, tmp_path):
    import torch

    from areal_jobs.trainer.forward.hf_logprobs import token_logprobs
    from areal_jobs.trainer.intake.dp_plan import plan_microbatches
    from areal_jobs.trainer.objective.router_loss import RouterLoss

    batch = make_batch(0)
    budget = two_microbatch_budget(lengths_of(batch))
    lead, other = run_ranks(step_worker, 2, str(moe_dir), str(tmp_path), budget)
    assert other["specs"] == [] and other["after"] == {}, "only rank 0 is a sender"
    assert lead["metrics"]["train/router_aux_loss"] == other["metrics"]["train/router_aux_loss"]
    compare_with_torch(moe_dir, lead, budget)
    check_export_and_checkpoint(moe_dir, lead, tmp_path)
    # the default budget: the plan's 2 x k micro-batches are not the torch backend's; the logged
    # loss is their token-weighted mean, each over its own tokens (trainer/fsdp/moe.py)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32)
    lengths = lengths_of(batch)
    router = RouterLoss(0.01)
    with torch.no_grad():
        for mb in (mb for rank in plan_microbatches(lengths, 2, 40) for mb in rank if mb):
            token_logprobs(model, [batch.samples[i] for i in mb], router=router)
            router.take(sum(lengths[i] for i in mb) / sum(lengths))
    expected = router.metrics()["train/router_aux_loss"]
    torch_value = megatron_harness.torch_backend_step(moe_dir, batch, trainer_config(1))[0][
        "train/router_aux_loss"
    ]
    print(
        f"default budget: fsdp {lead['aux_default_budget']:.6f}, plan {expected:.6f}, torch {torch_value:.6f}"
    )
    assert abs(lead["aux_default_budget"] - expected) < AUX_TOL


def routed_batch():
    """make_batch(0) with engine-style routes: random top-2 experts at every position and layer
    (not the router's own choice, so replay changes the step), the last token's row unreported,
    one sample without routes."""
    import dataclasses

    rng = np.random.default_rng(5)
    batch = make_batch(0)
    routed = []
    for s in batch.samples:
        routes = np.stack([rng.permutation(4)[:2] for _ in range(len(s.input_ids) * 2)]).reshape(-1, 2, 2)
        routes[-1] = 255
        routed.append(dataclasses.replace(s, routes=routes.astype(np.uint8)))
    routed[3] = dataclasses.replace(routed[3], routes=None)
    batch.samples = routed
    return batch


def replay_worker(rank: int, world: int, model_dir: str, budget: int) -> dict:
    from areal_jobs.config import RoutingReplay

    trainer = trainer_config(world, max_tokens_per_microbatch=budget, routing_replay=RoutingReplay.rollout)
    backend = start_backend(model_dir, trainer)
    before = exported(backend)
    metrics = backend.train_step(routed_batch() if rank == 0 else None)
    return {"before": before, "metrics": metrics, "after": exported(backend)}


def test_two_ranks_replay_the_rollouts_routes_as_the_torch_backend(moe_dir):
    """trainer.routing_replay=rollout: the routes travel with the broadcast batch (transport/
    batch_codec.py) and each rank's forward replays them through the torch backend's router hook."""
    from areal_jobs.config import RoutingReplay

    batch = routed_batch()
    budget = two_microbatch_budget(lengths_of(batch))
    lead, other = run_ranks(replay_worker, 2, str(moe_dir), budget)
    trainer = trainer_config(1, max_tokens_per_microbatch=budget, routing_replay=RoutingReplay.rollout)
    expected_metrics, expected = megatron_harness.torch_backend_step(moe_dir, batch, trainer)
    own = megatron_harness.torch_backend_step(
        moe_dir, batch, trainer_config(1, max_tokens_per_microbatch=budget)
    )
    got = lead["metrics"]
    weights, update = update_diff(lead["after"], expected, lead["before"])
    loss = abs(got["train/loss"] - expected_metrics["train/loss"])
    print(f"\nreplay vs torch: loss {loss:.1e}, weights_max {weights:.1e}, update_rel {update:.1e}")
    print(f"replay moved the loss by {abs(expected_metrics['train/loss'] - own[0]['train/loss']):.1e}")
    assert loss < LOSS_TOL and weights < WEIGHT_TOL and update < UPDATE_TOL
    assert abs(expected_metrics["train/loss"] - own[0]["train/loss"]) > 1e-4, "replay changed nothing"
    outputs = [s.num_output_tokens for s in batch.samples]
    fraction = (sum(outputs) - outputs[3]) / sum(outputs)
    assert got["train/routing_replay_token_fraction"] == pytest.approx(fraction)
    assert expected_metrics["train/routing_replay_token_fraction"] == pytest.approx(fraction)
    assert other["metrics"]["train/loss"] == got["train/loss"]
