"""dist_checkpointing save at TP=2, load at another layout, training continues (issue 3, point 3).

The TP=2 run takes a step, saves model + distributed-optimizer state, then takes two more steps.
A TP=1 run (and a PP=2 run) starts from the original HF weights, loads the checkpoint and takes
the same two steps: the losses must match, the second one only if the Adam moments came along.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import (
    exported,
    make_batch,
    make_tiny_hf,
    max_abs_diff,
    run_ranks,
    start_backend,
    trainer_config,
)

pytestmark = pytest.mark.megatron

LOSS_TOL = 1e-6  # measured about 1e-8
WEIGHT_TOL = 2e-5


def save_worker(rank: int, world: int, model_dir: str, ckpt_dir: str) -> dict:
    backend = start_backend(model_dir, trainer_config(tp=2))
    backend.train_step(make_batch(0) if rank == 0 else None)
    backend.save_checkpoint(ckpt_dir)
    saved = exported(backend)
    losses = [backend.train_step(make_batch(s) if rank == 0 else None)["train/loss"] for s in (1, 2)]
    return {"losses": losses, "saved": saved, "after": exported(backend)}


def load_worker(rank: int, world: int, model_dir: str, ckpt_dir: str, tp: int, pp: int) -> dict:
    backend = start_backend(model_dir, trainer_config(tp=tp, pp=pp))
    initial = exported(backend)
    backend.load_checkpoint(ckpt_dir)
    loaded = exported(backend)
    losses = [backend.train_step(make_batch(s) if rank == 0 else None)["train/loss"] for s in (1, 2)]
    return {
        "initial": initial,
        "loaded": loaded,
        "losses": losses,
        "after": exported(backend),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_ckpt")
    model_dir = make_tiny_hf(root / "llama", "llama", seed=3)
    ckpt = root / "ckpt"
    ranks = run_ranks(save_worker, 2, str(model_dir), str(ckpt), timeout_s=240)
    return model_dir, ckpt, ranks[0]


@pytest.mark.parametrize("layout", [(1, 1), (1, 2)], ids=["tp1", "pp2"])
def test_tp2_checkpoint_loads_at_another_layout_and_continues(saved, layout):
    model_dir, ckpt, reference = saved
    tp, pp = layout
    ranks = run_ranks(load_worker, tp * pp, str(model_dir), str(ckpt), tp, pp, timeout_s=240)

    def merge(key: str) -> dict[str, np.ndarray]:  # one sender per pipeline stage
        return {k: v for r in ranks for k, v in r[key].items()}

    assert max_abs_diff(merge("initial"), reference["saved"]) > 1e-4  # the load has work to do
    assert max_abs_diff(merge("loaded"), reference["saved"]) == 0.0
    losses = ranks[0]["losses"]
    weight_diff = max_abs_diff(merge("after"), reference["after"])
    print(
        f"[point 3] saved at tp=2, loaded at tp={tp} pp={pp}: losses {np.round(losses, 8).tolist()} vs "
        f"{np.round(reference['losses'], 8).tolist()}, max |d weights| after 2 steps {weight_diff:.1e}"
    )
    assert np.allclose(losses, reference["losses"], rtol=0, atol=LOSS_TOL)
    assert weight_diff < WEIGHT_TOL
