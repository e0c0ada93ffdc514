"""LoRA (model.lora.rank > 0) on the FSDP2 backend, 2 gloo ranks, against the torch backend.

The adapters are attached before `fully_shard`, so each decoder layer's group holds frozen base
weights and trainable adapters side by side (FSDP2 reduces gradients of the trainable ones only):
  - one step: loss, grad norm and the merged export (what ship=merged broadcasts) match the torch
    backend's LoRA step; the base never moves; each rank holds AdamW state for its adapter
    shards only (memory/*), and the adapters' PEFT directory equals the torch backend's;
  - the sharded checkpoint holds the adapters and their optimiser state only (the base is
    model.path's) and two fresh ranks resume from it with the same next step.
"""

from __future__ import annotations

from pathlib import Path

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

LORA_RANK = 4
LOSS_TOL = 1e-6
WEIGHT_TOL = 1e-4
UPDATE_TOL = 1e-3


def lora_config():
    from areal_jobs.config import LoraConfig

    return LoraConfig(rank=LORA_RANK, alpha=8.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_hf(tmp_path_factory.mktemp("fsdp_lora") / "qwen2", "qwen2", tied=True, seed=0)


def step_worker(rank: int, world: int, model_dir: str, adapter_dir: str) -> dict:
    backend = start_backend(model_dir, trainer_config(world), lora=lora_config())
    specs = [(s.name, s.dtype, s.shape) for s in backend.weight_specs()]
    before = exported(backend)
    metrics = backend.train_step(make_batch(0) if rank == 0 else None)
    backend.save_adapter(adapter_dir)
    return {"specs": specs, "before": before, "metrics": metrics, "after": exported(backend)}


def test_two_ranks_train_the_adapters_as_the_torch_backend(model, tmp_path):
    from areal_jobs.config import AlgoConfig, DType
    from areal_jobs.trainer.forward import lora
    from areal_jobs.trainer.torch.backend import TorchBackend

    lead, other = run_ranks(step_worker, 2, str(model), str(tmp_path / "fsdp_adapter"))
    expected_metrics, expected = megatron_harness.torch_backend_step(
        model, make_batch(0), trainer_config(2), lora=lora_config()
    )
    assert {name for name, _, _ in lead["specs"]} == set(expected) == set(megatron_harness.hf_state(model))
    assert max_abs_diff(lead["before"], megatron_harness.hf_state(model)) == 0.0  # B = 0: the base
    loss_diff = abs(lead["metrics"]["train/loss"] - expected_metrics["train/loss"])
    weight_diff, relative = update_diff(lead["after"], expected, lead["before"])
    print(
        f"\nFSDP LoRA: |Δloss| {loss_diff:.2e}, merged export max |Δ| {weight_diff:.2e}, relative {relative:.2e}"
    )
    assert loss_diff < LOSS_TOL
    assert abs(lead["metrics"]["train/grad_norm"] - expected_metrics["train/grad_norm"]) < 1e-4
    assert weight_diff < WEIGHT_TOL and relative < UPDATE_TOL
    assert max_abs_diff(lead["after"], lead["before"]) > 1e-4  # the merged policy moved
    # per rank: half of every adapter and its AdamW moments; the frozen base has no state
    for key in ("memory/param_bytes", "memory/trainable_param_bytes", "memory/optimizer_state_bytes"):
        total = lead["metrics"][key] + other["metrics"][key]
        assert total == pytest.approx(expected_metrics[key], rel=0.02), key
    assert expected_metrics["memory/trainable_param_bytes"] < 0.2 * expected_metrics["memory/param_bytes"]
    # the adapters as a PEFT directory: what ship=adapter loads into the servers
    torch_backend = TorchBackend(
        trainer_config(1), AlgoConfig(decoupled=True), str(model), DType.float32, lora_config()
    )
    torch_backend.setup()
    torch_backend.train_step(make_batch(0))
    torch_backend.save_adapter(str(tmp_path / "torch_adapter"))
    _, _, from_fsdp = lora.read_adapter_dir(tmp_path / "fsdp_adapter")
    _, _, from_torch = lora.read_adapter_dir(tmp_path / "torch_adapter")
    assert set(from_fsdp) == set(from_torch) and len(from_fsdp) == 2 * 2 * 7
    assert max(float((from_fsdp[k] - from_torch[k]).abs().max()) for k in from_torch) < WEIGHT_TOL


def resume_worker(rank: int, world: int, model_dir: str, ckpt: str, mode: str) -> dict:
    backend = start_backend(model_dir, trainer_config(world), lora=lora_config())
    if mode == "save":
        backend.train_step(make_batch(0) if rank == 0 else None)
        backend.save_checkpoint(ckpt)
    else:
        backend.load_checkpoint(ckpt)
    metrics = backend.train_step(make_batch(1) if rank == 0 else None)
    return {"loss": metrics["train/loss"], "after": exported(backend)}


def test_adapter_checkpoint_resumes_with_the_same_next_step(model, tmp_path):
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "ckpt"
    straight = run_ranks(resume_worker, 2, str(model), str(ckpt), "save")
    keys = dcp.FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    other = [k for k in model_keys if ".lora_A." not in k and ".lora_B." not in k]
    print(f"\ncheckpoint: {len(model_keys)} model tensors, not adapters: {other}")
    assert model_keys and not other
    assert any(k.startswith("optimizer.state.") and "lora_B" in k for k in keys)
    resumed = run_ranks(resume_worker, 2, str(model), str(ckpt), "load")
    assert resumed[0]["loss"] == pytest.approx(straight[0]["loss"], abs=1e-7)
    assert max_abs_diff(resumed[0]["after"], straight[0]["after"]) < 1e-6  # the Adam moments came back
