"""bf16, the production dtype, on one CPU process: Float16Module + the distributed optimizer with
fp32 main params, bf16 export, and a checkpoint round trip that continues with the same loss."""

from __future__ import annotations

import numpy as np
import pytest
from harness import (
    exported,
    hf_logits,
    make_batch,
    make_tiny_hf,
    max_abs_diff,
    run_ranks,
    start_backend,
    trainer_config,
)

pytestmark = pytest.mark.megatron


def bf16_worker(rank: int, world: int, model_dir: str, ckpt: str) -> dict:
    from areal_jobs.config import DType

    batch = make_batch(0)
    backend = start_backend(model_dir, trainer_config(), dtype=DType.bfloat16)
    logits = backend.full_logits([s.input_ids for s in batch.samples]).float().numpy()
    specs = {s.dtype for s in backend.weight_specs()}
    first = backend.train_step(batch)["train/loss"]
    backend.save_checkpoint(ckpt)
    saved = exported(backend)
    second = backend.train_step(make_batch(1))["train/loss"]

    fresh = start_backend(model_dir, trainer_config(), dtype=DType.bfloat16)
    fresh.load_checkpoint(ckpt)
    reloaded = exported(fresh)
    again = fresh.train_step(make_batch(1))["train/loss"]
    return {
        "logits": logits,
        "specs": specs,
        "losses": (first, second, again),
        "saved": saved,
        "reloaded": reloaded,
    }


def test_bf16_step_export_and_checkpoint(tmp_path):
    model_dir = make_tiny_hf(tmp_path / "qwen3", "qwen3", seed=5)
    (r,) = run_ranks(bf16_worker, 1, str(model_dir), str(tmp_path / "ckpt"), timeout_s=240)
    diff = float(np.abs(r["logits"] - hf_logits(model_dir, make_batch(0))).max())
    first, second, again = r["losses"]
    print(
        f"[bf16] max |logits - fp32 transformers| {diff:.1e}; losses {first:.6f}, {second:.6f} / reloaded {again:.6f}"
    )
    assert diff < 0.1  # bf16 weights and activations against the fp32 reference
    assert r["specs"] == {"bfloat16"}
    assert np.isfinite([first, second]).all()
    assert max_abs_diff(r["reloaded"], r["saved"]) == 0.0
    assert abs(again - second) < 1e-6
