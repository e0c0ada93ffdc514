"""What bench/trainer/gpu_trainer.py runs and how long it should take: the model config (a named
shape, optionally cut to its first N layers; the smoke's tiny one of the same kind), the points the
planner lets run, and the time model the budget is checked against. Pure (no torch).

The MoE shape (issue 44): `--shape qwen3_30b_a3b --layers 4` is Qwen3-30B-A3B's layer (128
experts of width 768, top-8, q/k norms) four times with its 151,936-token vocabulary: 3.1B
parameters, 0.85B active. The planner puts Megatron's step (bf16 weights, float32 grad buffer and
Adam state: 18 B/param) at 63 GiB with full recompute at 32k tokens, under an 80 GB H100's 76 GiB
usable; five layers would be 74 GiB, too close to trust an unmeasured model.
"""

from __future__ import annotations

from typing import Any

from bench.trainer import gpu_trainer_report as report
from launch.planning.fit.model_shape import NAMED_SHAPES

GPU_SIZES = (32768, 16384, 8192)
SMOKE_SIZES = (512, 256)
SMOKE_CONFIG = {
    "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512, "tie_word_embeddings": False,
}  # fmt: skip
# the smoke of an MoE shape: a 2-layer Qwen3-MoE, 4 experts of width 32, top-2, every layer sparse
SMOKE_MOE_CONFIG = {
    "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512,
    "tie_word_embeddings": False, "attention_bias": False, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
}  # fmt: skip
BEFORE = ("torch", "varlen")
AFTER = (("triton", "varlen"), ("triton", "varlen_attn"), ("triton", "flex"))
MODES = {"megatron": ("full", "none", "selective"), "torch": ("full", "none")}
TIMED_STEPS = 2
# time model of the budget check (GPU; refit from a run's wall_s): a step at ASSUMED_HFU of the
# device's peak (an MoE's experts, one small matmul each in Megatron's SequentialMLP and HF's
# per-expert loop, at ASSUMED_HFU_MOE: a guess until a run measures it), x1.5 for the torch head;
# per point the switching and synchronising; the random checkpoint (1.8B parameters, 3.6 GB
# written) and each process's start (imports, loading, optimiser), both scaled by the parameters
# above REFERENCE_PARAMS; FlexAttention's first compile (forward + backward) and its recompile for
# dynamic shapes at the second length, cheaper in the second process (inductor's on-disk cache
# holds the same graphs); compiling the decoder layers
ASSUMED_HFU = 0.25
ASSUMED_HFU_MOE = 0.10
REFERENCE_PARAMS = 1.8e9
GPU_COSTS_S = {
    "prepare": 30,
    "process": 30,
    "point": 2,
    "flex": 35,
    "flex_dynamic": 20,
    "flex_cached": 8,
    "compile": 60,
}
SMOKE_COSTS_S = {
    "prepare": 8,
    "process": 15,
    "point": 3,
    "flex": 0,
    "flex_dynamic": 0,
    "flex_cached": 0,
    "compile": 60,
}


def bench_config(name: str, layers: int | None, smoke: bool) -> tuple[dict[str, Any], str]:
    """(HF config, where it came from): the named shape, or on --smoke the tiny config of its kind
    (MoE or dense), with only its first `layers` decoder layers when given."""
    full = NAMED_SHAPES[name]
    moe = bool(full.get("num_experts"))
    config = dict((SMOKE_MOE_CONFIG if moe else SMOKE_CONFIG) if smoke else full)
    source = f"smoke ({config['model_type']})" if smoke else f"model.shape={name}"
    if layers is not None:
        if not 1 <= layers <= config["num_hidden_layers"]:
            raise ValueError(
                f"--layers {layers}: {source} has {config['num_hidden_layers']} layers; pass 1 to {config['num_hidden_layers']}"
            )
        source += f", its first {layers} of {config['num_hidden_layers']} layers"
        only = config.get("mlp_only_layers")
        config.update(
            num_hidden_layers=layers, **({"mlp_only_layers": [i for i in only if i < layers]} if only else {})
        )
    return config, source


def costs(shape, smoke: bool) -> dict[str, float]:
    """The time model's fixed costs; on a GPU the checkpoint's and each process's scaled by size."""
    if smoke:
        return dict(SMOKE_COSTS_S)
    scale = max(1.0, shape.num_params() / REFERENCE_PARAMS)
    return {k: v * scale if k in ("prepare", "process") else v for k, v in GPU_COSTS_S.items()}


def point_dict(backend, tokens, recompute, head, attention, lengths, compile_=False) -> dict:
    name = f"{backend} {tokens / 1024:g}k {recompute} {head}+{attention}" + ("+compile" if compile_ else "")
    return dict(name=name, backend=backend, tokens=tokens, recompute=recompute, head=head,
                attention=attention, compile=compile_, lengths=lengths)  # fmt: skip


def plan(
    args, shape, usable_bytes: int, backends: list[str], kv_repeat: bool
) -> tuple[list[dict], list[dict]]:
    """(points to run, points not planned: the planner puts them above the device), in running
    order: the largest size with full recompute first (the goal row), then the smaller sizes,
    then the other recompute modes where they fit, and compile last. `args.sizes` (tokens per
    micro-batch) and `args.no_compile` trim it (GPU only; the defaults: GPU_SIZES, compile)."""
    sizes = SMOKE_SIZES if args.smoke else tuple(getattr(args, "sizes", None) or GPU_SIZES)
    longest = 128 if args.smoke else 16384
    lengths = {t: report.sequence_lengths(t, seed=t, longest=longest) for t in sizes}
    dtype_bytes = 4 if args.smoke else 2
    run, not_planned = [], []
    for backend in backends:
        variants = {t: [BEFORE, *AFTER] if t == sizes[0] else [BEFORE, AFTER[1], AFTER[2]] for t in sizes}
        candidates = [(t, "full", variants[t]) for t in sizes]
        for mode in MODES[backend][1:]:
            chosen = [BEFORE, AFTER[1], AFTER[2]] if mode == "none" else [BEFORE, AFTER[2]]
            candidates += [(t, mode, chosen) for t in sizes]
        for tokens, mode, chosen in candidates:
            before = point_dict(backend, tokens, mode, *BEFORE, lengths[tokens])
            need = report.predict(shape, before, dtype_bytes, not args.smoke, kv_repeat).total_bytes
            if usable_bytes and need > usable_bytes:
                not_planned.append(
                    {
                        **before,
                        "status": f"not planned: predicted {need / 2**30:.1f} GiB > {usable_bytes / 2**30:.1f} usable",
                    }
                )
                continue
            run += [point_dict(backend, tokens, mode, h, a, lengths[tokens]) for h, a in chosen]
        if not args.smoke and not getattr(args, "no_compile", False):
            run.append(
                point_dict(backend, sizes[0], "full", "triton", "best", lengths[sizes[0]], compile_=True)
            )
    return run, not_planned


def estimate(points: list[dict], shape, peak: float | None, smoke: bool) -> list[float]:
    """Seconds per point (first compiles included where they fall), in running order."""
    fixed = SMOKE_COSTS_S if smoke else GPU_COSTS_S
    hfu = ASSUMED_HFU_MOE if shape.is_moe else ASSUMED_HFU
    out, flex_sizes = [], {}
    for p in points:
        seconds = fixed["point"]
        if not smoke and peak:
            hw = report.point_flops(shape, p)["hardware"] / (hfu * peak)
            seconds += (1 + TIMED_STEPS) * hw * (1.5 if p["head"] == "torch" else 1.0)
        if p["attention"] in ("flex", "best"):
            first_process = not flex_sizes or p["backend"] in flex_sizes and len(flex_sizes) == 1
            sizes = flex_sizes.setdefault(p["backend"], set())
            if len(sizes) < 2 and p["tokens"] not in sizes:  # the static compile, then the dynamic one
                seconds += (
                    fixed["flex_cached"]
                    if not first_process
                    else fixed["flex_dynamic"]
                    if sizes
                    else fixed["flex"]
                )
            sizes.add(p["tokens"])
        seconds += fixed["compile"] if p["compile"] else 0
        out.append(seconds)
    return out
