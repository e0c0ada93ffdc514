"""Backend contract (issue 18 section 1): one fixed batch, every objective setting, every backend.

The batch (contract_cases.py): 4 groups x 3 answers, lengths 1 to 24 with one cut at
max_new_tokens, an all-equal-reward group, holes in two samples' loss masks, behaviour
log-probs 1-2 versions stale. Each case of CASES (derived from the AlgoConfig schema) runs one
train step on fresh weights of a tiny random Qwen2 (tied embeddings, vocab 200 padded to 256)
on the torch backend, on Megatron at TP=1 and at TP=2 x DP=2, and on FSDP2 at DP=2 (gloo, one
spawned process per rank, reused across cases); Megatron at PP=2 runs the cases whose passes
cross its pipeline schedule in new ways (several optimiser steps, the reference model's
forward-only pass, the entropy's gradient). Compared against torch, per case:
  train/loss            |d| < 1e-6          (loss of order 0.1-1, fp32)
  train/grad_norm       |d| < 1e-4 relative
  updated weights       ||d|| / ||update|| < 1e-3 (harness.update_diff) and max |d| < 3e-4: the
                        first AdamW step moves every weight by about lr = 1e-3 whatever its
                        gradient, so on near-zero gradients (TP x DP summation order) rounding
                        shows as up to ~1.4e-4 here; the relative norm is the real measure
  ppo/*, mismatch/*,    |d| < 1e-5          (fractions: every token decides the same way)
  offpolicy/*                               (the |log w| p99, a histogram bin's edge: within
                                            one bin, a factor HIST_EDGES[2] / HIST_EDGES[1])
The case temperature_0p7 sets rollout.temperature (contract_cases.TEMPERATURE): every backend's
log-probs are of softmax(logits / 0.7), the policy that sampled.
The matrix holds several optimiser steps per batch (2 and 4 minibatches, current and recompute),
the reference KL with each estimator, GSPO's sequence ratio, the entropy bonus and reward
shaping (issue 26). Knobs a backend does not implement are refused by the config, naming the
override (config/support.py: prox_logp=loglinear on Megatron and FSDP).
Issue 42's objectives are rows too (icepop, m2po, prime, cispo_ess: contract_cases.py says why
each is set as it is). ONLY_CASES=icepop,m2po (environment) runs only those cases (and the
default, their baseline) on every layout: a new row checked alone.

Mixtures of experts (issue 44, MOE_CASES): the default objective on a tiny random Qwen3-MoE,
Megatron with its MoE layers at EP=1 and at EP=2 x DP=2 (the alltoall dispatcher over gloo)
and FSDP2 at DP=2 against the torch trainer, at the same tolerances, the load-balancing loss off
(contract_cases.py says why). `-k moe` runs only these (ONLY_CASES=moe_ep2: one layout).

How the step is computed (TRAINER_CASES: trainer.recompute=full|selective, trainer.attention=
dense) must not change it: each runs the default objective on every backend that implements it,
the torch backend included, and is compared with the torch backend's default step (recompute
none, attention varlen) at the same tolerances. Forward hooks count the decoder layers' and the
attention modules' calls, so a mode that silently does nothing fails: full runs every layer
again in backward, selective the attention only. trainer.recompute=selective is Megatron's
(its core attention) and refused by the torch and FSDP backends' config, naming the override.
"""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from contract_cases import (
    BASELINE,
    CASES,
    MOE_AUX_CASE,
    MOE_CASES,
    MOE_FSDP_CASES,
    MOE_TRAINER,
    NOT_OBJECTIVE,
    REFUSED,
    TRAINER_CASES,
    TRAINER_REFUSED,
    algo_for,
    batch_for,
    fsdp_worker,
    megatron_worker,
    runs_on,
    selected,
    selected_moe,
    torch_worker,
)
from harness import make_tiny_hf, run_ranks, update_diff

from areal_jobs.trainer.objective.loss_stats import HIST_EDGES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fsdp"))
from fsdp_harness import run_ranks as run_fsdp_ranks  # noqa: E402

pytestmark = pytest.mark.megatron

LOSS_TOL = 1e-6
GRAD_REL_TOL = 1e-4
WEIGHT_TOL = 3e-4
UPDATE_TOL = 1e-3
METRIC_TOL = 1e-5
# prox_logp=recompute: the pass that current skips gives the same p (case -> the case it equals)
SAME_AS = {"prox_recompute": "default", "minibatches_4_recompute": "minibatches_4"}
LAYOUTS = {"tp1": (1, 1, 1), "tp2dp2": (2, 1, 2), "pp2": (1, 2, 1)}  # Megatron (tp, pp, dp)
# layouts that run only some cases (every other layout runs all of CASES)
PARTIAL = {"pp2": ["default", "minibatches_4", "kl_k3", "entropy_bonus", "gspo_minibatches"]}
FSDP_WORLD = 2
COMPARED = [*LAYOUTS, "fsdp_dp2"]
BACKEND_OF = {
    "torch": "torch",
    "tp1": "megatron",
    "tp2dp2": "megatron",
    "pp2": "megatron",
    "fsdp_dp2": "fsdp",
}


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

    algo = AlgoConfig(decoupled=True, **{field: REFUSED[field]})  # loglinear: decoupled PPO's p
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
    cases = selected([*CASES, *TRAINER_CASES])
    out = {"torch": run_ranks(torch_worker, 1, model, cases, timeout_s=300)[0]}
    for name, (tp, pp, dp) in LAYOUTS.items():
        out[name] = run_ranks(
            megatron_worker,
            tp * pp * dp,
            tp,
            pp,
            dp,
            model,
            [c for c in PARTIAL.get(name, cases) if c in cases],
            timeout_s=300,
        )
    out["fsdp_dp2"] = run_fsdp_ranks(fsdp_worker, FSDP_WORLD, model, cases, timeout_s=300)
    return out


def merged(ranks: list[dict], case: str) -> dict[str, np.ndarray]:
    weights: dict[str, np.ndarray] = {}
    for r in ranks:
        weights.update(r[case]["after"])
    return weights


ONE_BIN = float(HIST_EDGES[2] / HIST_EDGES[1])  # the |log w| histogram's bin ratio


def metric_diff(key: str, got: float, ref: float) -> float:
    """|got - ref|; for the histogram's p99, 0 when within one bin (a 1e-7 difference in log w
    may cross a bin edge: the quantile is only resolved to a bin)."""
    if key == "offpolicy/abs_log_w_p99":
        return 0.0 if max(got, ref) <= min(got, ref) * ONE_BIN * (1 + 1e-9) else abs(got - ref)
    return abs(got - ref)


def compare(got: dict, ref: dict, after: dict, ref_after: dict, before: dict) -> dict[str, float]:
    """The contract's columns for one step against the torch trainer's."""
    weight_diff, update_rel = update_diff(after, ref_after, before)
    # train/lr_scale: algo.ess_step's factor, from the ESS summed over every rank
    keys = sorted(
        k for k in ref if k.startswith(("ppo/", "mismatch/", "offpolicy/")) or k == "train/lr_scale"
    )
    assert keys and set(keys) <= set(got), sorted(set(keys) - set(got))
    assert "offpolicy/preclip_fraction" in keys
    return {
        "loss": abs(got["train/loss"] - ref["train/loss"]),
        "grad_norm_rel": abs(got["train/grad_norm"] - ref["train/grad_norm"]) / ref["train/grad_norm"],
        "weights_max": weight_diff,
        "update_rel": update_rel,
        "metrics_max": max(metric_diff(k, got[k], ref[k]) for k in keys),
    }


LIMITS = {
    "loss": LOSS_TOL,
    "grad_norm_rel": GRAD_REL_TOL,
    "weights_max": WEIGHT_TOL,
    "update_rel": UPDATE_TOL,
    "metrics_max": METRIC_TOL,
}


@pytest.fixture(scope="module")
def moe_results(tmp_path_factory):
    cases = selected_moe()
    if not cases:
        pytest.skip(f"ONLY_CASES selects none of {sorted(MOE_CASES)}")
    model = str(
        make_tiny_hf(tmp_path_factory.mktemp("contract_moe") / "qwen3_moe", "qwen3_moe", tied=True, seed=3)
    )
    runs = ["default", MOE_AUX_CASE]
    out = {"torch": run_ranks(torch_worker, 1, model, runs, MOE_TRAINER, timeout_s=300)[0]}
    megatron = [c for c in cases if c in MOE_CASES]
    for case in (c for c in cases if c in MOE_FSDP_CASES):
        out[case] = run_fsdp_ranks(fsdp_worker, MOE_FSDP_CASES[case], model, runs, MOE_TRAINER, timeout_s=300)
    for case in megatron:
        tp, pp, dp, ep = MOE_CASES[case]
        overrides = {**MOE_TRAINER, "ep_size": ep}
        mine = runs if case == megatron[-1] else ["default"]  # the aux-loss run once, on the widest layout
        out[case] = run_ranks(
            megatron_worker, tp * pp * dp, tp, pp, dp, model, mine, overrides, timeout_s=300
        )
    return out


def test_moe_layouts_agree_with_torch(moe_results):
    """Megatron's MoE layers, dispatcher and expert conversion, and FSDP2's sharded experts, give
    the torch trainer's step: loss, gradient norm, updated weights (every expert's, gathered over
    EP or the FSDP shards) and the log-prob statistics."""
    t = moe_results["torch"]
    ref = t["default"]["metrics"]
    rows, failures = [], []
    for case in (c for c in [*MOE_CASES, *MOE_FSDP_CASES] if c in moe_results):
        ranks = moe_results[case]
        after = merged(ranks, "default")
        assert any(".mlp.experts.3.down_proj.weight" in k for k in after), sorted(after)[:8]
        diffs = compare(ranks[0]["default"]["metrics"], ref, after, t["default"]["after"], t["before"])
        rows.append(f"{case:10s} " + " ".join(f"{v:9.1e}" for v in diffs.values()))
        if any(v >= LIMITS[k] for k, v in diffs.items()):
            failures.append(f"{case}: {diffs}")
    print("\ncase            loss grad_norm   weights    update   metrics")
    print("\n".join(rows))
    assert not failures, "\n".join(failures)


def test_moe_router_aux_loss_acts_on_both(moe_results):
    """With the model config's weight (0.01) the load-balancing loss moves the routers on every
    backend and is logged; Megatron defines it differently (megatron/router_aux.py) and FSDP at DP 2
    computes it over other micro-batches (trainer/fsdp/moe.py), so the steps are not compared here,
    only the logged values (all score top_k = 2 when balanced) for their scale."""
    t = moe_results["torch"]
    layouts = [c for c in reversed(MOE_CASES) if c in moe_results][:1] + [
        c for c in MOE_FSDP_CASES if c in moe_results
    ]
    router = "model.layers.0.mlp.gate.weight"
    rows = []
    for name, ranks in (("torch", [t]), *((c, moe_results[c]) for c in layouts)):
        off, on = merged(ranks, "default"), merged(ranks, MOE_AUX_CASE)
        moved = float(np.abs(on[router] - off[router]).max())
        value = ranks[0][MOE_AUX_CASE]["metrics"]["train/router_aux_loss"]
        rows.append((name, moved, value))
        assert moved > 0, f"{name}: router_aux_loss_coef=0.01 left the router where 0 put it"
        assert 1.9 < value < 2.5, f"{name}: train/router_aux_loss={value}, balanced top-2 routing scores 2"
    print("\nbackend      router moved by aux   train/router_aux_loss")
    print("\n".join(f"{n:12s} {m:9.1e}             {v:.4f}" for n, m, v in rows))


def test_backends_agree_on_every_case(results):
    torch_out = results["torch"]
    before = torch_out["before"]
    rows, failures = [], []
    worst: dict[str, float] = {}
    for case in selected([*CASES, *TRAINER_CASES]):
        reference = "default" if case in TRAINER_CASES else case  # the same step, computed otherwise
        ref = torch_out[reference]["metrics"]
        assert batch_for(case).samples, case
        for layout in [*COMPARED, "torch"] if case in TRAINER_CASES else COMPARED:
            if not runs_on(case, BACKEND_OF[layout]) or case not in PARTIAL.get(layout, [case]):
                continue  # refused by that backend's config (test_trainer_refusals), or not run there
            ranks = [results["torch"]] if layout == "torch" else results[layout]
            got = ranks[0][case]["metrics"]
            diffs = compare(got, ref, merged(ranks, case), torch_out[reference]["after"], before)
            for column, value in diffs.items():
                worst[column] = max(worst.get(column, 0.0), value)
            rows.append(f"{case:20s} {layout:7s} " + " ".join(f"{v:9.1e}" for v in diffs.values()))
            if any(v >= LIMITS[k] for k, v in diffs.items()):
                keys = [k for k in ref if k.startswith(("ppo/", "mismatch/", "offpolicy/"))]
                bad = [k for k in keys if metric_diff(k, got[k], ref[k]) >= METRIC_TOL]
                failures.append(f"{case} {layout}: {diffs} {bad}")
    print("\ncase                 layout       loss grad_norm   weights    update   metrics")
    print("\n".join(rows))
    print("max per column: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    assert not failures, "\n".join(failures)


def test_cases_exercise_their_knob(results):
    """A case that changes nothing would pass vacuously: each knob must move the torch loss or
    its statistics away from the default's."""
    t = results["torch"]
    for case in selected(CASES):  # TRAINER_CASES: test_trainer_cases_run_their_mode
        if case == "default":
            continue
        m = t[case]["metrics"]
        if case in SAME_AS:  # another way to the same numbers: it must give them
            same = t[SAME_AS[case]]["metrics"]
            assert abs(m["train/loss"] - same["train/loss"]) < LOSS_TOL, case
            assert all(abs(m[k] - same[k]) < METRIC_TOL for k in m if k.startswith(("ppo/", "mismatch/"))), (
                case
            )
            continue
        if case == "cispo_ess":  # the step's lr is scaled: sqrt of the ESS the loss measured (one minibatch)
            assert (
                m["train/lr_scale"] == pytest.approx(m["ppo/step_ess"] ** 0.5, rel=1e-9)
                and m["train/lr_scale"] < 1
            )
        base = t[BASELINE.get(case, "default")]["metrics"]
        moved = abs(m["train/loss"] - base["train/loss"]) > 1e-7 or any(
            abs(m[k] - base[k]) > 1e-7 for k in m if k.startswith(("ppo/", "mismatch/", "train/num_"))
        )
        assert moved, f"case {case} trains exactly like {BASELINE.get(case, 'default')}"


def test_trainer_cases_run_their_mode(results):
    """Same numbers, other work: full recompute runs every decoder layer again in backward,
    selective only the core attention; dense attention runs what the default runs."""
    for layout in ["torch", *(name for name in COMPARED if name not in PARTIAL)]:
        out = results[layout] if layout == "torch" else results[layout][0]
        base = out["default"]["forwards"]
        assert base["layers"] > 0 and base["attention"] > 0, (layout, base)
        for case in selected(TRAINER_CASES):
            if not runs_on(case, BACKEND_OF[layout]):
                assert case not in out, (layout, case)
                continue
            got = out[case]["forwards"]
            expected = {
                "recompute_full": {"layers": 2 * base["layers"], "attention": 2 * base["attention"]},
                "recompute_selective": {"layers": base["layers"], "attention": 2 * base["attention"]},
                "attention_dense": base,
            }[case]
            assert got == expected, (layout, case, got, base)


@pytest.mark.parametrize("case", sorted(c for c, backends in TRAINER_REFUSED.items() if backends))
def test_trainer_refusals(case):
    """A trainer case a backend does not implement is refused when the config is built, with the
    override to change."""
    from contract_cases import trainer_for

    from areal_jobs.config import TrainerBackend, TrainerConfig

    for backend in TRAINER_REFUSED[case]:
        with pytest.raises(
            ValueError, match=r"trainer\.recompute=selective .*trainer=megatron.*trainer\.recompute=full"
        ):
            trainer_for(case, TrainerConfig(backend=TrainerBackend(backend)))
    for backend in set(BACKEND_OF.values()) - set(TRAINER_REFUSED[case]):
        trainer_for(case, TrainerConfig(backend=TrainerBackend(backend)))


def test_every_trainer_mode_is_covered():
    """Every value of trainer.recompute and trainer.attention is the default, a TRAINER_CASE or
    CUDA-only (refused on CPU; checked on a GPU)."""
    from contract_cases import CUDA_ONLY

    from areal_jobs.config import Attention, Recompute, TrainerConfig

    default = TrainerConfig()
    for field, enum in (("recompute", Recompute), ("attention", Attention)):
        covered = {case[field] for case in TRAINER_CASES.values() if field in case}
        covered |= {getattr(default, field).value} | CUDA_ONLY.get(field, set())
        assert covered == {v.value for v in enum}, field
