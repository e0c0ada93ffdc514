"""The backend contract's matrix, derived from the AlgoConfig schema, and its fixed inputs.

Every AlgoConfig field is in exactly one of:
  IN_MATRIX  changes the loss or the batch the backends see: at least one case sets it;
  REFUSED    refused on some backend at config validation (config/support.py); the test checks
             the refusal instead of comparing (a field with one refused value, prox_logp=loglinear,
             may also be in the matrix with its other values);
  NOT_OBJECTIVE  decides which groups are generated and when (admission, staleness, batch shape):
             the backends never see it.
A new field in none of them fails test_every_algo_field_is_covered.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

from harness import VOCAB, exported, trainer_config  # noqa: E402

# decoupled=True: the matrix's knobs (behaviour-weight modes, prox_logp, the minibatch cases) act
# on the decoupled objective; the default since issue 42, naive PPO, is the decoupled_false case
BASE = dict(batch_size=4, group_size=3, max_staleness=4, decoupled=True)
MAX_NEW_TOKENS = 24

# name -> overrides. Clip cases run with decoupled=false: with one minibatch the proximal policy
# IS the current one (r = 1), so only stale behaviour log-probs as the anchor make r != 1.
CASES: dict[str, dict] = {
    "default": {},
    # the same numbers as the default (current) from its own proximal pass: test_cases_exercise_their_knob
    "prox_recompute": dict(prox_logp="recompute"),
    "decoupled_false": dict(decoupled=False),
    "clip_higher": dict(decoupled=False, eps_clip_high=0.28),
    "dual_clip": dict(decoupled=False, dual_clip_c=1.2),
    "drop_cap": dict(behav_weight_cap=1.1),
    "truncate": dict(behav_weight_mode="truncate", behav_weight_cap=1.1),
    "seq_mask": dict(behav_weight_mode="seq_mask", mis_low=0.9, mis_high=1.1),
    "seq_mean_token_mean": dict(loss_agg="seq_mean_token_mean"),
    "seq_mean_token_sum": dict(loss_agg="seq_mean_token_sum"),
    "drgrpo_norm": dict(loss_agg="seq_mean_token_sum_norm", advantage="drgrpo"),
    "rloo": dict(advantage="rloo"),
    "biased_std_eps": dict(adv_std="biased", adv_eps=1e-3),
    "adv_batch_norm": dict(adv_batch_norm=True),
    "overlong": dict(overlong_buffer=8, overlong_penalty=0.5),
    "mask_truncated": dict(mask_truncated=True),
    "filter_uniform": dict(filter_uniform_groups=True),
    "temperature_0p7": {},  # the sampling temperature (TEMPERATURE): every backend's softmax(z / 0.7)
    # issue 26: several optimiser steps per batch; later minibatches see a moved policy (r != 1)
    "minibatches_2": dict(ppo_minibatches=2),
    "minibatches_4": dict(ppo_minibatches=4),
    "minibatches_4_recompute": dict(ppo_minibatches=4, prox_logp="recompute"),
    # KL to the initial weights is 0 at the first step (θ = ref): the second minibatch shows it
    "kl_k1": dict(ppo_minibatches=2, kl_coef=0.5, kl_estimator="k1"),
    "kl_k2": dict(ppo_minibatches=2, kl_coef=0.5, kl_estimator="k2"),
    "kl_k3": dict(ppo_minibatches=2, kl_coef=0.5, kl_estimator="k3"),
    "gspo": dict(decoupled=False, importance_level="sequence"),
    "gspo_minibatches": dict(ppo_minibatches=2, importance_level="sequence"),
    "entropy_bonus": dict(entropy_coef=0.05),
    # GRPO cancels scale and bias, not the clip: group [0.3, 0.7, 1.0] -> [-2, 2, 5 -> 3]
    "reward_shaping": dict(reward_scaling=10.0, reward_bias=-0.5, reward_clip=3.0),
    # issue 42's objectives (docs/objective.md). A mask on w = π_p / π_b at the token level:
    "icepop": dict(objective="icepop", icepop_low=0.8, icepop_high=1.25, icepop_level="token"),
    # M2PO chooses its clip width per micro-batch, and the layouts split the batch differently
    # (DP ranks, token budgets): under a budget below every harmful token's (log r)², τ = 0 in
    # every micro-batch whatever the split, so the harmful tokens lose their gradient everywhere
    # and the layouts must agree; tests/unit/trainer/test_trainer_objectives.py pins τ itself
    "m2po": dict(objective="m2po", m2_budget=1e-9, m2po_min_eps_low=0.0, m2po_max_eps_high=0.0),
    # bands small enough to act on a random model's probabilities (~1/200)
    "prime": dict(objective="prime", prime_mask_low=0.001, prime_mask_high=0.001, prime_kl_coef=0.5),
    # the ESS-scaled step's lr needs the ESS of the whole minibatch, summed over the ranks
    "cispo_ess": dict(objective="cispo", cispo_eps_low=0.1, cispo_eps_high=0.05, ess_step="sqrt"),
}
# train steps per case (1 when not listed), compared after the last: the second step of kl_k3
# checks that the reference stayed the initial weights while the policy moved
STEPS = {"kl_k3": 2}
# the case each one must differ from (test_cases_exercise_their_knob); default when not listed
BASELINE = {
    "minibatches_4_recompute": "minibatches_4",
    "kl_k1": "minibatches_2",
    "kl_k2": "minibatches_2",
    "kl_k3": "minibatches_2",
    "gspo_minibatches": "minibatches_2",
}
# ONLY_CASES=a,b (environment): run only these cases of CASES and TRAINER_CASES (every backend's
# gloo run of the whole matrix takes long; a new row can be checked alone). Unset: all of them.
ONLY_CASES = [c for c in os.environ.get("ONLY_CASES", "").split(",") if c]


def selected(names) -> list[str]:
    """The cases of `names` this run covers (ONLY_CASES; the default, every case's baseline, always)."""
    return [c for c in names if not ONLY_CASES or c in ONLY_CASES or c == "default"]


# rollout.temperature per case (1.0 where absent): the trainer's log-probs are of the tempered
# policy, so it changes the loss without being an AlgoConfig field
TEMPERATURE = {"temperature_0p7": 0.7}
# prox_logp=loglinear: torch only (LIMITED_VALUES)
REFUSED = {"prox_logp": "loglinear"}
NOT_OBJECTIVE = {"max_staleness", "exact_delay", "batch_size", "group_size", "max_discarded_groups"}
# algo.max_staleness=auto: the controller's admission bound, not part of the loss
NOT_OBJECTIVE |= {
    "staleness_auto", "staleness_ceiling", "staleness_floor", "staleness_drift", "staleness_drift_target",
    "staleness_raise_below", "staleness_hold_steps", "staleness_window_steps",
}  # fmt: skip

# How the step is computed, not what it computes: trainer.* settings (on the default objective)
# whose step must equal the torch backend's default one (trainer.recompute=none,
# trainer.attention=varlen) at the same tolerances, on every backend that implements them.
TRAINER_CASES: dict[str, dict] = {
    "recompute_full": dict(recompute="full"),
    "recompute_selective": dict(recompute="selective"),
    "attention_dense": dict(attention="dense"),
}
# trainer.* values the backends run on CUDA only and refuse on CPU by name: their kernels are checked
# against the CPU paths on a GPU (tests/gpu/test_trainer_kernels_gpu.py) and on CPU as far as torch
# runs them there (tests/unit/trainer/test_trainer_packed_attention.py: flex forward, varlen_attn's
# arguments)
CUDA_ONLY: dict[str, set[str]] = {"attention": {"varlen_attn", "flex"}}
# trainer case -> the backends whose config refuses it (TrainerConfig.__post_init__)
TRAINER_REFUSED: dict[str, tuple[str, ...]] = {"recompute_selective": ("torch", "fsdp")}

# Mixture of experts (issue 44): the default objective on a tiny random Qwen3-MoE (harness.
# make_tiny_hf "qwen3_moe": 4 experts, top-2), Megatron (tp, pp, dp, ep) against the torch trainer.
# The load-balancing loss is off on both (trainer.router_aux_loss_coef=0): the two define it
# differently (HF pools f_e and P_e over the layers and scores top_k when balanced, Megatron sums
# per-layer losses scoring 1 each; docs/moe.md), so with it on the gradients differ by design.
MOE_CASES: dict[str, tuple[int, int, int, int]] = {"moe_ep1": (1, 1, 1, 1), "moe_ep2": (1, 1, 2, 2)}
# FSDP2 at DP 2 (case -> ranks): the same row through fully_shard. Its balancing loss is the torch
# backend's definition per micro-batch (trainer/fsdp/moe.py); test_fsdp_moe.py compares it on
MOE_FSDP_CASES: dict[str, int] = {"moe_fsdp_dp2": 2}
MOE_TRAINER = {"router_aux_loss_coef": 0.0}
# run after the default in the same processes: the model config's weight (0.01), the loss on; not
# compared across backends (see above), only shown to act and to score alike (its logged value)
MOE_AUX_CASE = "router_aux"


def selected_moe() -> list[str]:
    """The MoE cases this run covers (ONLY_CASES; all of them when unset)."""
    return [c for c in [*MOE_CASES, *MOE_FSDP_CASES] if not ONLY_CASES or c in ONLY_CASES]


def trainer_for(case: str, base):
    """`base` (a TrainerConfig) with the trainer case's overrides; unchanged for objective cases."""
    from areal_jobs.config import Attention, Recompute

    enums = {"recompute": Recompute, "attention": Attention}
    if case == MOE_AUX_CASE:
        return replace(base, router_aux_loss_coef=None)
    return replace(base, **{k: enums[k](v) for k, v in TRAINER_CASES.get(case, {}).items()})


def runs_on(case: str, backend: str) -> bool:
    return backend not in TRAINER_REFUSED.get(case, ())


def algo_for(case: str):
    from areal_jobs.config.algo import (
        Advantage,
        AdvStd,
        AlgoConfig,
        BehavWeightMode,
        EssStep,
        ImportanceLevel,
        KLEstimator,
        LossAgg,
        MaskLevel,
        Objective,
        ProxLogp,
    )

    enums = {
        "advantage": Advantage,
        "adv_std": AdvStd,
        "behav_weight_mode": BehavWeightMode,
        "loss_agg": LossAgg,
        "prox_logp": ProxLogp,
        "kl_estimator": KLEstimator,
        "importance_level": ImportanceLevel,
        "objective": Objective,
        "icepop_level": MaskLevel,
        "ess_step": EssStep,
    }
    fields = {k: enums[k](v) if k in enums else v for k, v in CASES.get(case, {}).items()}
    return AlgoConfig(**{**BASE, **fields})


def groups():
    """4 prompt groups x 3 answers, lengths 1..24 (one cut at max_new_tokens), one all-equal
    reward group, behaviour log-probs 1-2 versions stale and noisy."""
    from areal_jobs.transport import messages as m

    rng = np.random.default_rng(7)
    rewards = [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.3, 0.7, 1.0]]
    lengths = [[24, 3, 9], [5, 1, 12], [2, 17, 6], [11, 4, 8]]
    out = []
    for g in range(4):
        samples = []
        for i in range(3):
            n = lengths[g][i]
            samples.append(
                m.SampleTrajectory(
                    sample_id=f"g{g}/{i}",
                    output_ids=rng.integers(1, VOCAB, size=n).astype(np.int32),
                    logprobs=(np.log(1.0 / VOCAB) + 0.3 * rng.standard_normal(n)).astype(np.float32),
                    versions=np.full(n, 1 + (g + i) % 2, dtype=np.int32),
                    reward=rewards[g][i],
                    reward_status="ok",
                    finish_reason="length" if n == MAX_NEW_TOKENS else "stop",
                    num_interruptions=0,
                )
            )
        prompt = rng.integers(1, VOCAB, size=int(rng.integers(3, 9))).astype(np.int32)
        out.append(m.TrajectoryGroup(f"g{g}", g, prompt, tuple(samples)))
    return out


def batch_for(case: str):
    """The fixed batch as `assemble` builds it for this case's AlgoConfig, plus masked tokens
    (a loss mask with holes on two samples), at trainer version 3."""
    from areal_jobs.trainer.intake.batch import assemble

    batch = assemble(groups(), 3, algo_for(case), MAX_NEW_TOKENS)
    for index in (2, 5):
        s = batch.samples[index]
        mask = np.ones(s.num_output_tokens, np.uint8) if s.loss_mask is None else s.loss_mask.copy()
        mask[1::3] = 0
        batch.samples[index] = replace(s, loss_mask=mask)
    return batch


def forward_counter(root):
    """Forward pre-hooks on `root`'s decoder layers and attention modules (HF `layers.N` and
    `self_attn`, Megatron `layers.N` and `core_attention`): how often each kind started,
    recomputation in backward included (pre-hooks: torch's non-reentrant checkpoint stops a
    recomputation once it has the tensors it needs, before the layer returns). Returns
    (counts, remove)."""
    import re

    counts = {"layers": 0, "attention": 0}
    handles = []
    for name, module in root.named_modules():
        kind = "layers" if re.search(r"layers\.\d+$", name) else None
        kind = "attention" if name.endswith(("self_attn", "core_attention")) else kind
        if kind:
            handles.append(
                module.register_forward_pre_hook(lambda *_, k=kind: counts.__setitem__(k, counts[k] + 1))
            )
    assert handles, "no decoder layers found"
    return counts, lambda: [h.remove() for h in handles]


def _step(backend, root, case: str, rank: int) -> dict:
    """The case's train steps (STEPS) on `backend`; the metrics of the last."""
    counts, remove = forward_counter(root)
    for _ in range(STEPS.get(case, 1)):
        metrics = backend.train_step(batch_for(case) if rank == 0 else None)
    remove()
    return {"metrics": metrics, "forwards": dict(counts)}


def _each_case(make_backend, root_of, rank: int, cases: list[str]) -> dict:
    """Every case on fresh weights of a new backend in this one spawned rank (ranks reused);
    global rank 0 passes the batch, as the trainer does."""
    import gc

    out = {}
    for case in cases:
        backend = make_backend(case)
        backend.setup()
        out[case] = _step(backend, root_of(backend), case, rank)
        out[case]["after"] = exported(backend)
        del backend
        gc.collect()
    return out


def megatron_worker(
    rank: int, world: int, tp: int, pp: int, dp: int, model_dir: str, cases: list[str], overrides=None
) -> dict:
    from areal_jobs.config import DType
    from areal_jobs.trainer.megatron.backend import MegatronBackend
    from areal_jobs.trainer.megatron.dist import init_distributed

    cfg = trainer_config(tp, pp, dp, **(overrides or {}))
    init_distributed(cfg, timeout_s=120.0)
    return _each_case(
        lambda case: MegatronBackend(
            trainer_for(case, cfg),
            algo_for(case),
            model_dir,
            DType.float32,
            temperature=TEMPERATURE.get(case, 1.0),
        ),
        lambda backend: backend._gpt,
        rank,
        [c for c in cases if runs_on(c, "megatron")],
    )


def torch_worker(rank: int, world: int, model_dir: str, cases: list[str], overrides=None) -> dict:
    from areal_jobs.config import DType, TrainerBackend
    from areal_jobs.trainer.torch.backend import TorchBackend

    cfg = replace(trainer_config(**(overrides or {})), backend=TrainerBackend.torch)
    out = {}
    for case in [c for c in cases if runs_on(c, "torch")]:
        backend = TorchBackend(
            trainer_for(case, cfg),
            algo_for(case),
            model_dir,
            DType.float32,
            temperature=TEMPERATURE.get(case, 1.0),
        )
        backend.setup()
        if not out:
            out["before"] = {k: v.detach().numpy().copy() for k, v in backend.iter_weights()}
        out[case] = _step(backend, backend.model, case, rank)
        out[case]["after"] = {k: v.detach().numpy().copy() for k, v in backend.iter_weights()}
    return out


def fsdp_worker(rank: int, world: int, model_dir: str, cases: list[str], overrides=None) -> dict:
    """One spawned FSDP2 rank (DP over `world`)."""
    from areal_jobs.config import DType, TrainerBackend
    from areal_jobs.trainer.fsdp.backend import FSDPBackend, init_distributed

    cfg = replace(trainer_config(**(overrides or {})), backend=TrainerBackend.fsdp, dp_size=world)
    init_distributed(cfg, timeout_s=120.0)
    return _each_case(
        lambda case: FSDPBackend(
            trainer_for(case, cfg),
            algo_for(case),
            model_dir,
            DType.float32,
            temperature=TEMPERATURE.get(case, 1.0),
        ),
        lambda backend: backend.model,
        rank,
        [c for c in cases if runs_on(c, "fsdp")],
    )
