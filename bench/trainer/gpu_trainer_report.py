"""What bench/trainer/gpu_trainer.py counts and prints: FLOPs in three units, the peak table, the batch
shape, the planner's prediction of a point, the markdown table and the memory model's refit. Pure
(no torch): unit-tested on CPU.

FLOPs of one training step of one packed micro-batch of T tokens (sequences l_i, n scored tokens),
a model of L layers, hidden H, query width q (heads x head_dim), P_layer parameters per layer,
N parameters in all, vocabulary V:
  ours   3 x forward, forward = 2 P_layer L T + 2 V H n (the head on the scored rows only)
         + 2 L q sum(l_i^2) (QK^T and PV, causal: half of 4 L q l^2 per sequence)
         A mixture of experts' sparse layer counts, in P_layer, the matmuls a token goes through:
         attention, the router (E x H) and its top-k experts (k x 3 H Fm), not the E experts nor
         the dense intermediate_size (plus a shared expert, 3 H Fs, and its 1-wide gate)
  peers  (6 N + 12 L H S) T with S = T the packed length: no causal discount, every token through
         the head, N with the embeddings (prime-rl's trainer benchmark; reproduces its published
         11.08% for Qwen3-0.6B at 11,896 tokens/s, 16k, H100); for a mixture of experts N is the
         active parameters (ModelShape.active_params), as MoE papers and trainers report MFU
  HFU    ours + what recompute runs again: the chunked head's logits in backward (both head
         kernels) always, and per trainer.recompute: full = one more forward of every layer,
         selective = the core attention's forward
MFU = FLOPs / step time / the device's dense bf16 peak (PEAK_BF16_FLOPS).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from areal_jobs.config import TrainerBackend
from launch.planning.fit.memory import TrainerMemoryInputs, trainer_memory

# dense bf16 tensor-core peak per device, by name as torch reports it (first match wins; no sparsity).
# NVIDIA's datasheets give the with-sparsity figure: H100 SXM 1,979 TFLOP/s -> 989 dense; H100 PCIe
# 1,513 -> 756; H100 NVL 1,671 -> 835; H200 SXM 1,979 -> 989 (same SMs and clocks as H100 SXM);
# H800 SXM as H100 SXM; A100/A800 312 dense.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
)
PEAK_SOURCE = "NVIDIA H100/H200 datasheets, bf16 dense (half the with-sparsity figure)"


def peak_flops(device_name: str) -> float | None:
    return next((peak for name, peak in PEAK_BF16_FLOPS if name in device_name), None)


def sequence_lengths(tokens: int, seed: int, longest: int = 16384, shortest: int = 64) -> list[int]:
    """Lengths of RL samples packed into exactly `tokens` tokens: log-normal around 3,000 tokens
    (long-tailed reasoning answers), each in [shortest, min(longest, tokens)], the last one cut to
    fill the row. Deterministic in `seed`."""
    import random

    rng = random.Random(seed)
    cap = min(longest, tokens)
    lengths: list[int] = []
    while (rest := tokens - sum(lengths)) > 0:
        n = min(rest, int(min(cap, max(shortest, rng.lognormvariate(math.log(3000), 1.0)))))
        if 0 < rest - n < shortest:  # it would leave a stub shorter than any sample
            n = rest if rest <= cap else min(cap, rest - shortest)
        lengths.append(n)
    return lengths


def prompt_tokens(length: int) -> int:
    """A sample's prompt: a quarter of it, at most 256 tokens, at least 1, leaving an answer."""
    return max(1, min(256, length // 4))


def scored_tokens(lengths: list[int]) -> int:
    return sum(n - prompt_tokens(n) for n in lengths)


def predict(shape, point: dict, dtype_bytes: int, on_gpu: bool, kv_repeat: bool):
    attention = "flex" if point["attention"] == "best" else point["attention"]
    x = TrainerMemoryInputs(
        backend=TrainerBackend(point["backend"]), param_bytes=dtype_bytes, compute_bytes=dtype_bytes,
        tp=1, pp=1, dp=1, tokens=point["tokens"], scored_tokens=scored_tokens(point["lengths"]),
        recompute=point["recompute"], attention=attention, logprob_chunk_tokens=1024,
        vocab_multiple=128 if point["backend"] == "megatron" else 1, on_gpu=on_gpu,
        logprob_kernel=point["head"], compile=point["compile"], kv_repeat=kv_repeat and attention == "varlen_attn",
    )  # fmt: skip
    return trainer_memory(shape, x)


def layer_matmul_params(hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int) -> int:
    q, kv = heads * head_dim, kv_heads * head_dim
    return hidden * (q + 2 * kv) + q * hidden + 3 * hidden * ffn


def step_flops(
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ffn: int,
    vocab: int,
    num_params: int,
    lengths: Sequence[int],
    scored: int,
    recompute: str,
    moe_layers: int = 0,
    experts: int = 0,
    topk: int = 0,
    moe_ffn: int = 0,
    shared_ffn: int = 0,
) -> dict[str, float]:
    """{"ours", "peers", "hardware"} FLOPs of one forward + backward over the packed row. A mixture
    of experts: `moe_layers` of the `layers` are sparse (`experts` of width `moe_ffn`, each token
    through `topk`, a shared expert of `shared_ffn`), `num_params` its active parameters."""
    tokens = sum(lengths)
    q = heads * head_dim
    dense = layer_matmul_params(hidden, heads, kv_heads, head_dim, ffn)
    sparse = layer_matmul_params(hidden, heads, kv_heads, head_dim, topk * moe_ffn + shared_ffn)
    sparse += experts * hidden + (hidden if shared_ffn else 0)  # the router, the shared expert's gate
    layer_fwd = 2 * ((layers - moe_layers) * dense + moe_layers * sparse) * tokens
    attn_fwd = 2 * layers * q * sum(n * n for n in lengths)
    head_fwd = 2 * vocab * hidden * scored
    ours = 3 * (layer_fwd + attn_fwd + head_fwd)
    peers = (6 * num_params + 12 * layers * hidden * tokens) * tokens
    again = head_fwd + {"full": layer_fwd + attn_fwd, "selective": attn_fwd}.get(recompute, 0)
    return {"ours": float(ours), "peers": float(peers), "hardware": float(ours + again)}


def point_flops(shape, point: dict) -> dict[str, float]:
    """step_flops of a launch/planning/fit ModelShape (a dense one: moe_layers 0, every parameter active)."""
    return step_flops(
        layers=shape.num_layers, hidden=shape.hidden_size, heads=shape.num_heads, kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, ffn=shape.intermediate_size, vocab=shape.vocab_size, num_params=shape.active_params(),
        lengths=point["lengths"], scored=scored_tokens(point["lengths"]), recompute=point["recompute"],
        moe_layers=shape.moe_layers, experts=shape.num_experts, topk=shape.experts_per_token,
        moe_ffn=shape.moe_intermediate_size, shared_ffn=shape.shared_expert_intermediate_size,
    )  # fmt: skip


def utilisation(flops: dict[str, float], step_s: float, peak: float | None) -> dict[str, float | None]:
    if not peak or step_s <= 0:
        return {"mfu_ours": None, "mfu_peers": None, "hfu": None}
    per_s = peak * step_s
    return {
        "mfu_ours": flops["ours"] / per_s,
        "mfu_peers": flops["peers"] / per_s,
        "hfu": flops["hardware"] / per_s,
    }


def fit_overheads(rows: list[dict]) -> dict[str, float]:
    """What launch/planning/fit/memory.GpuOverheads would take to fit the measured GPU points (medians
    over the points that ran): the allocator's reserve fraction, the memory outside the allocator,
    and per attention kind / compile the allocated bytes above the prediction."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("peak_reserved_bytes")]
    if not ok:
        return {}
    out = {
        "reserve_fraction": statistics.median(
            r["peak_reserved_bytes"] / r["peak_allocated_bytes"] - 1 for r in ok
        ),
        "runtime_bytes": statistics.median(r["outside_allocator_bytes"] for r in ok),
    }
    for key in sorted({(r["attention"], r["compile"]) for r in ok}):
        excess = [
            r["peak_allocated_bytes"] - r["predicted_allocated_bytes"]
            for r in ok
            if (r["attention"], r["compile"]) == key
        ]
        out[f"allocated_above_prediction_bytes/{key[0]}{'+compile' if key[1] else ''}"] = statistics.median(
            excess
        )
    return out


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def _short(status: str) -> str:
    """The table's status: a refusal by its first clause (the JSON keeps the whole message)."""
    return status.split(",")[0] if status.startswith("refused") else status[:120]


def markdown(result: dict) -> str:
    """The points as one markdown table, the device and versions above it, the refit below."""
    head = result["device"]
    lines = [
        f"### bench.trainer.gpu_trainer: {head['name']}, torch {head['torch']}, triton {head['triton']}, "
        f"{result['shape']}, {result['dtype']}",
        "",
        f"`{result['command']}`; peak {head['peak_tflops'] or '-'} TFLOP/s ({PEAK_SOURCE}); "
        f"wall {result['wall_s']:.0f} s of a {result['budget_s']:.0f} s budget. MFU ours: causal, "
        "actual lengths; peers: 6N + 12·L·H·S, S the packed length (prime-rl), N active for an MoE; "
        "HFU: recompute counted.",
        "",
        "| backend | tokens | recompute | head | attention | compile | tokens/s | MFU ours | MFU peers | HFU "
        "| alloc GiB | pred | meas/pred | reserved GiB | pred | meas/pred | status |",
        "|---|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["points"]:
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        lines.append(
            f"| {r['backend']} | {r['tokens']:,} | {r['recompute']} | {r['head']} | {r['attention']} | "
            f"{'yes' if r['compile'] else 'no'} | {tps} | {_pct(r.get('mfu_ours'))} | "
            f"{_pct(r.get('mfu_peers'))} | {_pct(r.get('hfu'))} | {_gib(r.get('peak_allocated_bytes'))} | "
            f"{_gib(r.get('predicted_allocated_bytes'))} | "
            f"{_ratio(r.get('peak_allocated_bytes'), r.get('predicted_allocated_bytes'))} | "
            f"{_gib(r.get('peak_reserved_bytes'))} | {_gib(r.get('predicted_reserved_bytes'))} | "
            f"{_ratio(r.get('peak_reserved_bytes'), r.get('predicted_reserved_bytes'))} | {_short(r['status'])} |"
        )
    if result.get("fit"):
        lines += [
            "",
            "Memory model refit (launch/planning/fit/memory.GpuOverheads), medians over the points:",
        ]
        lines += [
            f"- {k}: {v / 2**30:.3f} GiB" if k.endswith("bytes") or "/" in k else f"- {k}: {v:.3f}"
            for k, v in result["fit"].items()
        ]
    for note in result.get("notes", []):
        lines += ["", note]
    return "\n".join(lines)
