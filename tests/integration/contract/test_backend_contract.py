"""Backend contract (issue 18 section 1): one fixed batch, every objective setting, every backend.

The batch (contract_cases.py): 4 groups x 3 answers, lengths 1 to 24 with one cut at
max_new_tokens, an all-equal-reward group, holes in two samples' loss masks, behaviour
log-probs 1-2 versions stale. Each case of CASES (derived from the AlgoConfig schema) runs one
train step on fresh weights of a tiny random Qwen2 (tied embeddings, vocab 200 padded to 256)
on the torch backend, on Megatron at TP=1 and at TP=2 x DP=2, and on FSDP2 at DP=2 (gloo, one
spawned process per rank, reused across cases). Compared against torch, per case:
  train/loss            |d| < 1e-6          (loss of order 0.1-1, fp32)
  train/grad_norm       |d| < 1e-4 relative
  updated weights       ||d|| / ||update|| < 1e-3 (harness.update_diff) and max |d| < 3e-4: the
                        first AdamW step moves every weight by about lr = 1e-3 whatever its
                        gradient, so on near-zero gradients (TP x DP summation order) rounding
                        shows as up to ~1.4e-4 here; the relative norm is the real measure
  ppo/*, mismatch/*     |d| < 1e-5          (fractions: every token decides the same way)
Knobs a backend does not implement are refused by the config, naming the override
(config/support.py: Megatron ppo_minibatches > 1 and kl_coef; FSDP kl_coef).
"""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from contract_cases import (
    CASES,
    NOT_OBJECTIVE,
    REFUSED,
    algo_for,
    batch_for,
    fsdp_worker,
    megatron_worker,
    torch_worker,
)
from harness import make_tiny_hf, run_ranks, update_diff

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fsdp"))
from fsdp_harness import run_ranks as run_fsdp_ranks  # noqa: E402

pytestmark = pytest.mark.megatron

LOSS_TOL = 1e-6
GRAD_REL_TOL = 1e-4
WEIGHT_TOL = 3e-4
UPDATE_TOL = 1e-3
METRIC_TOL = 1e-5
# prox_logp=recompute: the pass that the default (current) skips gives the same p
SAME_AS_DEFAULT = {"prox_recompute"}
LAYOUTS = {"tp1": (1, 1), "tp2dp2": (2, 2)}  # Megatron (tp, dp)
FSDP_WORLD = 2
COMPARED = [*LAYOUTS, "fsdp_dp2"]


def test_every_algo_field_is_covered():
    from areal_jobs.config import AlgoConfig
    from areal_jobs.config.support import LIMITED, LIMITED_VALUES

    in_matrix = {k for case in CASES.values() for k in case}
    names = {f.name for f in fields(AlgoConfig)}
    # clip_eps is covered by every case (its value is the base); the rest must be set by a case
    unlisted = names - in_matrix - set(REFUSED) - NOT_OBJECTIVE - {"clip_eps"}
    assert not unlisted, f"AlgoConfig fields in no contract case, refusal or exemption: {sorted(unlisted)}"
    assert set(LIMITED) | {name for name, _ in LIMITED_VALUES} <= set(REFUSED)
    for case in CASES:
        algo_for(case)  # every case is a valid config


@pytest.mark.parametrize("field", sorted(k for k, v in REFUSED.items() if v is not None))
def test_megatron_refuses_what_it_does_not_implement(field):
    from areal_jobs.config import AlgoConfig, JobConfig, TrainerBackend, TrainerConfig

    algo = AlgoConfig(**{field: REFUSED[field]})
    with pytest.raises(ValueError, match=rf"algo\.{field}=.*trainer=megatron.*trainer=torch"):
        JobConfig(algo=algo, trainer=TrainerConfig(backend=TrainerBackend.megatron))


def test_megatron_refuses_lora():
    """model.lora.rank > 0 trains adapters on the torch and FSDP backends (tests/integration/fsdp/
    test_fsdp_lora.py compares the two); Megatron refuses it (config/support.py LORA_BACKENDS)."""
    from areal_jobs.config import JobConfig, LoraConfig, ModelConfig, TrainerBackend, TrainerConfig
    from areal_jobs.config.support import LORA_BACKENDS

    lora = ModelConfig(lora=LoraConfig(rank=8))
    with pytest.raises(ValueError, match=r"model\.lora\.rank=8 .*trainer=megatron.*trainer=torch/fsdp"):
        JobConfig(model=lora, trainer=TrainerConfig(backend=TrainerBackend.megatron))
    assert LORA_BACKENDS == ("torch", "fsdp")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    model = str(make_tiny_hf(tmp_path_factory.mktemp("contract") / "qwen2", "qwen2", tied=True, seed=3))
    cases = list(CASES)
    out = {"torch": run_ranks(torch_worker, 1, model, cases, timeout_s=300)[0]}
    for name, (tp, dp) in LAYOUTS.items():
        out[name] = run_ranks(megatron_worker, tp * dp, tp, dp, model, cases, timeout_s=300)
    out["fsdp_dp2"] = run_fsdp_ranks(fsdp_worker, FSDP_WORLD, model, cases, timeout_s=300)
    return out


def merged(ranks: list[dict], case: str) -> dict[str, np.ndarray]:
    weights: dict[str, np.ndarray] = {}
    for r in ranks:
        weights.update(r[case]["after"])
    return weights


def test_backends_agree_on_every_case(results):
    torch_out = results["torch"]
    before = torch_out["before"]
    rows, failures = [], []
    worst: dict[str, float] = {}
    for case in CASES:
        ref = torch_out[case]["metrics"]
        assert batch_for(case).samples, case
        for layout in COMPARED:
            got = results[layout][0][case]["metrics"]
            weight_diff, update_rel = update_diff(
                merged(results[layout], case), torch_out[case]["after"], before
            )
            keys = sorted(k for k in ref if k.startswith(("ppo/", "mismatch/")))
            assert keys and set(keys) <= set(got), (case, layout, sorted(set(keys) - set(got)))
            diffs = {
                "loss": abs(got["train/loss"] - ref["train/loss"]),
                "grad_norm_rel": abs(got["train/grad_norm"] - ref["train/grad_norm"])
                / ref["train/grad_norm"],
                "weights_max": weight_diff,
                "update_rel": update_rel,
                "metrics_max": max(abs(got[k] - ref[k]) for k in keys),
            }
            for column, value in diffs.items():
                worst[column] = max(worst.get(column, 0.0), value)
            rows.append(f"{case:20s} {layout:7s} " + " ".join(f"{v:9.1e}" for v in diffs.values()))
            limits = (LOSS_TOL, GRAD_REL_TOL, WEIGHT_TOL, UPDATE_TOL, METRIC_TOL)
            if any(v >= lim for v, lim in zip(diffs.values(), limits, strict=True)):
                bad = [k for k in keys if abs(got[k] - ref[k]) >= METRIC_TOL]
                failures.append(f"{case} {layout}: {diffs} {bad}")
    print("\ncase                 layout       loss grad_norm   weights    update   metrics")
    print("\n".join(rows))
    print("max per column: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert not failures, "\n".join(failures)


def test_cases_exercise_their_knob(results):
    """A case that changes nothing would pass vacuously: each knob must move the torch loss or
    its statistics away from the default's."""
    t = results["torch"]
    default = t["default"]["metrics"]
    for case in CASES:
        if case == "default":
            continue
        m = t[case]["metrics"]
        if case in SAME_AS_DEFAULT:  # another way to the same numbers: it must give them
            assert abs(m["train/loss"] - default["train/loss"]) < LOSS_TOL, case
            assert all(
                abs(m[k] - default[k]) < METRIC_TOL for k in m if k.startswith(("ppo/", "mismatch/"))
            ), case
            continue
        moved = abs(m["train/loss"] - default["train/loss"]) > 1e-7 or any(
            abs(m[k] - default[k]) > 1e-7 for k in m if k.startswith(("ppo/", "mismatch/", "train/num_"))
        )
        assert moved, f"case {case} trains exactly like the default"
