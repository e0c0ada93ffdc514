"""Megatron-Core MoE with expert parallelism over gloo (issue 44, item 2).

A tiny random Qwen3-MoE (harness.make_tiny_hf "qwen3_moe": 4 experts, top-2, attention biases) at
EP=2 x DP=2, two spawned ranks, each holding two experts per layer:
  - fp32 logits match transformers (the alltoall dispatcher moves tokens between the ranks);
  - the export the engines receive (`weight_specs` + `iter_weights`, gathered over the EP group)
    is exactly the HF checkpoint, every expert under its name, in the announced order and shapes;
  - `save_hf` writes a directory transformers loads to the same logits;
  - a dist checkpoint of model + optimizer taken after a train step restores the experts after
    another step moved them.
The step itself is compared with the torch trainer in the backend contract (`-k moe`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from harness import (
    exported,
    hf_logits,
    hf_state,
    make_batch,
    make_tiny_hf,
    max_abs_diff,
    run_ranks,
    start_backend,
    trainer_config,
)

pytestmark = pytest.mark.megatron

LOGIT_TOL = 1e-5  # fp32; measured 9.5e-7


def ep_worker(rank: int, world: int, model: str, out_dir: str) -> dict:
    backend = start_backend(model, trainer_config(1, 1, world, ep_size=world, router_aux_loss_coef=0.0))
    batch = make_batch(0)
    logits = backend.full_logits([s.input_ids for s in batch.samples])
    result = {
        "logits": None if logits is None else logits.numpy(),
        "specs": [(s.name, tuple(s.shape)) for s in backend.weight_specs()],
        "order": [],
        "weights": {},
    }
    for name, tensor in backend.iter_weights():
        result["order"].append((name, tuple(tensor.shape)))
        result["weights"][name] = tensor.float().numpy().copy()
    backend.save_hf(str(Path(out_dir) / "hf"))
    backend.train_step(batch if rank == 0 else None)
    backend.save_checkpoint(str(Path(out_dir) / "ckpt"))
    result["saved"] = exported(backend)
    backend.train_step(make_batch(1) if rank == 0 else None)
    result["moved"] = exported(backend)
    backend.load_checkpoint(str(Path(out_dir) / "ckpt"))
    result["restored"] = exported(backend)
    return result


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    model = make_tiny_hf(root / "qwen3_moe", "qwen3_moe", tied=True, seed=3)
    return model, root, run_ranks(ep_worker, 2, str(model), str(root), timeout_s=300)


def test_logits_match_transformers_across_expert_parallel_ranks(ep2):
    model, _, ranks = ep2
    ref = hf_logits(model, make_batch(0))
    diff = float(np.abs(ranks[0]["logits"] - ref).max())
    print(f"\nEP=2 logits vs transformers: max |d| {diff:.1e}")
    assert diff < LOGIT_TOL
    assert ranks[1]["logits"] is not None  # both ranks are the last stage (DP 2)


def test_the_export_is_the_checkpoint_with_every_expert(ep2):
    model, _, ranks = ep2
    state = hf_state(model)
    sender, peer = ranks
    assert max_abs_diff(sender["weights"], state) == 0.0
    assert sender["specs"] == sender["order"]  # what the engines are told is what arrives
    assert {n for n in state if ".experts." in n} <= set(sender["weights"])
    assert peer["specs"] == [] and peer["weights"] == {}  # EP rank 1 only joins the gathers


def test_save_hf_reloads_in_transformers(ep2):
    model, root, _ = ep2
    ref = hf_logits(model, make_batch(0))
    assert max_abs_diff(hf_state(root / "hf"), hf_state(model)) == 0.0
    assert float(np.abs(hf_logits(root / "hf", make_batch(0)) - ref).max()) < LOGIT_TOL


def test_dist_checkpoint_restores_the_experts(ep2):
    _, _, ranks = ep2
    sender = ranks[0]
    expert = "model.layers.1.mlp.experts.3.down_proj.weight"  # held by EP rank 1
    assert np.abs(sender["moved"][expert] - sender["saved"][expert]).max() > 0  # the step moved it
    assert max_abs_diff(sender["restored"], sender["saved"]) == 0.0
