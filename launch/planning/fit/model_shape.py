"""The policy's shape, as the memory planner needs it: from `model.path`'s config.json, else a name.

Pure (json, no torch). `resolve_shape(job)` reads `<model.path>/config.json` (the built-in model's
directory when model.path is empty) and falls back to `model.shape`, a named shape of the table
below, for the committed experiments whose model directory is a placeholder on this machine. When
both exist, config.json wins: it is the model that will run.

Named shapes are the public config.json values of the checkpoints the recipes name (Qwen2
architecture: bias on q/k/v only, SwiGLU MLP, RMSNorm):
  qwen2_0p5b   Qwen2-0.5B (the GPU test's shape, tests/gpu/test_megatron_gpu.py), tied embeddings
  qwen2_1p5b   DeepSeek-R1-Distill-Qwen-1.5B (Qwen2.5-Math-1.5B): 1.78B parameters, untied
  qwen2_7b     DeepSeek-R1-Distill-Qwen-7B (Qwen2.5-Math-7B): 7.6B, untied
  qwen2_14b    DeepSeek-R1-Distill-Qwen-14B (Qwen2.5-14B): 14.8B, untied
  qwen3_30b_a3b  Qwen3-30B-A3B (Qwen3-MoE: q/k RMSNorm, no biases, 128 experts of width 768, 8 per
               token, every layer sparse, no shared expert): 30.5B parameters, 3.3B active, untied

Mixtures of experts (Qwen3-MoE `qwen3_moe`, Qwen2-MoE `qwen2_moe` and their relatives): a decoder
layer is sparse when `num_experts` > 0, its index is not in `mlp_only_layers` and
(index + 1) % `decoder_sparse_step` == 0 (transformers' rule); a sparse layer's MLP is the router
(num_experts x H, no bias), `num_experts` SwiGLU experts of `moe_intermediate_size` and, for
Qwen2-MoE, a shared expert of `shared_expert_intermediate_size` with its 1-wide gate. The other
layers keep the dense MLP of `intermediate_size`. Each token goes through `num_experts_per_tok`
experts: the active parameters.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_jobs.config import JobConfig


@dataclass(frozen=True)
class ModelShape:
    """What sizes the memory: widths, depth, heads and vocabulary of a decoder-only model."""

    source: str  # where it came from: a config.json path or "model.shape=<name>"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool = True  # Qwen2
    qk_norm: bool = False  # Qwen3
    # mixture of experts (0 experts: dense). moe_layers counts the sparse layers (module docstring)
    num_experts: int = 0
    experts_per_token: int = 0  # num_experts_per_tok: the top-k each token is routed to
    moe_intermediate_size: int = 0  # one expert's SwiGLU width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (Qwen3-MoE has none)
    moe_layers: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and self.moe_layers > 0

    @property
    def attention_params(self) -> int:
        """One layer's attention: q, k, v, o (+ q/k/v biases, q/k norms) and the two RMSNorms."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attention = h * (q + 2 * kv) + q * h
        if self.qkv_bias:
            attention += q + 2 * kv
        if self.qk_norm:
            attention += 2 * d
        return attention + 2 * h

    @property
    def dense_layer_params(self) -> int:
        """A dense decoder layer: attention and a SwiGLU MLP of intermediate_size."""
        return self.attention_params + 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params_per_layer(self) -> int:
        """A sparse layer's routed experts (what expert parallelism splits)."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def router_params(self) -> int:
        """A sparse layer's router (num_experts x H), and Qwen2-MoE's shared-expert gate (H)."""
        gate = self.hidden_size if self.shared_expert_intermediate_size else 0
        return self.num_experts * self.hidden_size + gate

    @property
    def shared_expert_params(self) -> int:
        return 3 * self.hidden_size * self.shared_expert_intermediate_size

    @property
    def moe_layer_params(self) -> int:
        """A sparse decoder layer, every expert counted."""
        return (
            self.attention_params
            + self.router_params
            + self.shared_expert_params
            + self.expert_params_per_layer
        )

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers

    @property
    def layer_params(self) -> int:
        """The largest decoder layer (a dense model's every layer): what sizes one pipeline stage
        and FSDP2's gathered units. For a mixture of experts, every expert counted."""
        if not self.is_moe:
            return self.dense_layer_params
        return max(self.moe_layer_params, self.dense_layer_params if self.dense_layers else 0)

    def embedding_params(self, vocab_multiple: int = 1) -> int:
        return padded_vocab(self.vocab_size, vocab_multiple) * self.hidden_size

    def num_params(self, vocab_multiple: int = 1) -> int:
        """Every parameter (the output layer counted once when tied; every expert)."""
        embeddings = self.embedding_params(vocab_multiple) * (1 if self.tied_embeddings else 2)
        layers = self.dense_layers * self.dense_layer_params + self.moe_layers * self.moe_layer_params
        return embeddings + layers + self.hidden_size

    def active_params(self, vocab_multiple: int = 1) -> int:
        """The parameters one token goes through: every expert replaced by the top-k it is
        routed to (the router and a shared expert included). A dense model: num_params."""
        unused = (
            (self.num_experts - self.experts_per_token) * 3 * self.hidden_size * self.moe_intermediate_size
        )
        return self.num_params(vocab_multiple) - self.moe_layers * unused

    def expert_params(self) -> int:
        """The routed experts of every sparse layer (the rest is replicated over expert parallelism)."""
        return self.moe_layers * self.expert_params_per_layer

    def kv_bytes_per_token(self, dtype_bytes: int, tp_size: int = 1) -> int:
        """KV cache per token on one GPU of a server of `tp_size` GPUs: K and V of every layer.
        KV heads are split over TP and replicated when TP exceeds them (SGLang and vLLM alike)."""
        heads = max(1, self.num_kv_heads // tp_size)
        return 2 * self.num_layers * heads * self.head_dim * dtype_bytes


def padded_vocab(vocab: int, multiple: int) -> int:
    return -(-vocab // multiple) * multiple


def shape_from_hf_config(cfg: Mapping[str, Any], source: str) -> ModelShape:
    """ModelShape from an HF config.json dict (Llama, Qwen2, Qwen3 and their relatives)."""
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        family = cfg.get("model_type", "")
        layers = int(cfg["num_hidden_layers"])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        return ModelShape(
            source=source,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            num_experts=experts,
            experts_per_token=int(cfg["num_experts_per_tok"]) if experts else 0,
            # Mixtral's experts are intermediate_size wide (it has no dense layers)
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
            if experts
            else 0,
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
            if experts
            else 0,
            moe_layers=_sparse_layers(cfg, layers) if experts else 0,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: not a decoder config the memory planner reads ({exc!r})") from None


def _sparse_layers(cfg: Mapping[str, Any], layers: int) -> int:
    """How many layers are sparse, by transformers' Qwen2/3-MoE rule: not in mlp_only_layers and
    (index + 1) a multiple of decoder_sparse_step. A model without the keys (Mixtral): all."""
    dense_only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    return sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)


def _qwen2(hidden, layers, heads, kv_heads, ffn, vocab, tied) -> dict[str, Any]:
    return {
        "model_type": "qwen2",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
    }


NAMED_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2_0p5b": _qwen2(896, 24, 14, 2, 4864, 151936, True),
    "qwen2_1p5b": _qwen2(1536, 28, 12, 2, 8960, 151936, False),
    "qwen2_7b": _qwen2(3584, 28, 28, 4, 18944, 152064, False),
    "qwen2_14b": _qwen2(5120, 48, 40, 8, 13824, 152064, False),
    # Qwen/Qwen3-30B-A3B's config.json (the keys the planner reads)
    "qwen3_30b_a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,  # the dense MLP no layer uses (mlp_only_layers is empty)
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
}


def named_shape(name: str) -> ModelShape:
    if name not in NAMED_SHAPES:
        raise ValueError(f"model.shape={name!r} is not a named shape: use one of {sorted(NAMED_SHAPES)}")
    return shape_from_hf_config(NAMED_SHAPES[name], f"model.shape={name}")


def resolve_shape(job: JobConfig) -> ModelShape | None:
    """config.json of the model that will run, else `model.shape`, else None (unknown)."""
    directory = job.model.path or job.model.builtin_dir
    config = Path(directory) / "config.json"
    if config.is_file():
        return shape_from_hf_config(json.loads(config.read_text()), str(config))
    if job.model.shape:
        return named_shape(job.model.shape)
    return None
