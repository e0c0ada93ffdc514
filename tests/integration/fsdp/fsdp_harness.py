"""Shared pieces of the FSDP tests: spawned gloo ranks, plus the Megatron tests' tiny HF models and
synthetic batches (tests/integration/megatron/harness.py, loaded by path: no Megatron needed).

`run_ranks` is the Megatron harness's, with the FSDP backend's shutdown: each rank is a fresh
`spawn` process with the env:// variables torchrun sets; a rank error or a hung collective fails
the test at a hard deadline.
"""

from __future__ import annotations

import importlib.util
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location(
    "megatron_harness", Path(__file__).resolve().parents[1] / "megatron" / "harness.py"
)
megatron_harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(megatron_harness)
make_tiny_hf = megatron_harness.make_tiny_hf
make_batch = megatron_harness.make_batch
max_abs_diff = megatron_harness.max_abs_diff
update_diff = megatron_harness.update_diff


def _entry(fn: Callable, rank: int, world: int, port: int, results: Any, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    try:
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        from areal_jobs.trainer.fsdp.backend import shutdown_distributed

        shutdown_distributed()


def run_ranks(fn: Callable, world: int, *args: Any, timeout_s: float = 240.0) -> list[Any]:
    """Run `fn(rank, world, *args)` in `world` spawned processes; their results by rank."""
    original = megatron_harness._entry
    megatron_harness._entry = _entry  # the same supervision, another shutdown
    try:
        return megatron_harness.run_ranks(fn, world, *args, timeout_s=timeout_s)
    finally:
        megatron_harness._entry = original


def trainer_config(dp: int, **overrides: Any):
    from areal_jobs.config import TrainerBackend, TrainerConfig

    fields = {"lr": 1e-3, "grad_clip": 1.0, "max_tokens_per_microbatch": 40, "weight_decay": 0.01, "seed": 1}
    fields.update(overrides)
    return TrainerConfig(backend=TrainerBackend.fsdp, dp_size=dp, **fields)


def start_backend(model_dir: Path | str, trainer, algo=None, dtype=None, lora=None):
    """init_distributed + FSDPBackend(...).setup(), as trainer/main.py does."""
    from areal_jobs.config import AlgoConfig, DType
    from areal_jobs.trainer.fsdp.backend import FSDPBackend, init_distributed

    init_distributed(trainer, timeout_s=120.0)
    # decoupled: what these parity steps were written against (the default before issue 42);
    # naive PPO, the default now, is the backend contract's decoupled_false case
    backend = FSDPBackend(
        trainer, algo or AlgoConfig(decoupled=True), str(model_dir), dtype or DType.float32, lora
    )
    backend.setup()
    return backend


def exported(backend) -> dict:
    """Every rank joins the export; rank 0 returns the HF-named tensors as numpy arrays."""
    return {name: t.float().numpy().copy() for name, t in backend.iter_weights()}
