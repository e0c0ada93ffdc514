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

    @property
    def layer_params(self) -> int:
        """One decoder layer: attention (q, k, v, o + biases, q/k norms), SwiGLU MLP, two norms."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attention = h * (q + 2 * kv) + q * h
        if self.qkv_bias:
            attention += q + 2 * kv
        if self.qk_norm:
            attention += 2 * d
        return attention + 3 * h * self.intermediate_size + 2 * h

    def embedding_params(self, vocab_multiple: int = 1) -> int:
        return padded_vocab(self.vocab_size, vocab_multiple) * self.hidden_size

    def num_params(self, vocab_multiple: int = 1) -> int:
        """Every parameter (the output layer counted once when tied)."""
        embeddings = self.embedding_params(vocab_multiple) * (1 if self.tied_embeddings else 2)
        return embeddings + self.num_layers * self.layer_params + self.hidden_size

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
        return ModelShape(
            source=source,
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: not a decoder config the memory planner reads ({exc!r})") from None


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
