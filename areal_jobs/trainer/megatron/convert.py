"""Hugging Face <-> Megatron-Core state-dict adapter for the Llama, Qwen2 and Qwen3 families.

Pure tensor code (torch only, no megatron, no distributed), so every rule is unit-testable.
Shapes: h hidden, f ffn, d head_dim, n_q attention heads, n_g KV heads (query groups),
q = n_q / n_g query heads per group, V vocab, Vp padded vocab.

  HF q_proj [n_q*d, h], k_proj / v_proj [n_g*d, h]
      -> Megatron linear_qkv [n_g*(q+2)*d, h]: per group, its q query heads, its key, its value
  HF gate_proj / up_proj [f, h] -> Megatron linear_fc1 [2f, h]; TP rank r holds [gate_r; up_r]
  HF embed_tokens / lm_head [V, h] -> [Vp, h], padded with zero rows (see `padded_vocab_size`)

Tensor parallelism: column-parallel weights (qkv, fc1, embedding, output layer) are split along
dim 0, row-parallel ones (attention proj, fc2) along dim 1, norms are replicated. Splitting the
grouped qkv along dim 0 hands each rank whole groups, which is how Megatron lays them out.
Pipeline parallelism: stage s holds global layers [s*L/pp, (s+1)*L/pp), numbered from 0
locally; the embedding lives on the first stage, the final norm and output layer on the last.
With tied embeddings and pp > 1 the last stage holds a copy of the embedding as its output
layer; HF holds only `model.embed_tokens.weight`, so that copy is loaded but never exported.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

FAMILIES = ("llama", "qwen2", "qwen3")


class Kind(enum.Enum):
    replicated = "replicated"  # norms: the same full tensor on every TP rank
    vocab = "vocab"  # embedding / output layer: padded vocab rows, split along dim 0
    qkv = "qkv"  # fused, grouped q/k/v (weight or bias), split along dim 0
    gate_up = "gate_up"  # fused gate/up, each half split along dim 0
    row = "row"  # row-parallel weight, split along dim 1


@dataclass(frozen=True)
class ModelDims:
    """What the adapter and the Megatron model builder need from an HF config.json."""

    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool  # Qwen2: bias on q/k/v only
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on queries and keys
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], *, vocab_multiple: int = 128) -> ModelDims:
        """Parse an HF config.json dict; raises ValueError for features the adapter lacks."""
        family = cfg.get("model_type", "")
        if family not in FAMILIES:
            raise ValueError(f"trainer=megatron supports model_type {FAMILIES}, got {family!r}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg.get('hidden_act')!r} is not supported (only silu)")
        if (cfg.get("attention_bias") and family != "qwen2") or cfg.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias on o_proj or the MLP is not supported")
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported by trainer=megatron")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope scaling {rope} is not supported by trainer=megatron")
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        vocab = int(cfg["vocab_size"])
        return cls(
            family=family,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=int(cfg["hidden_size"]),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            vocab_size=vocab,
            padded_vocab_size=padded_vocab_size(vocab, vocab_multiple),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        )

    def check_layout(self, tp_size: int, pp_size: int) -> None:
        """Raise ValueError (naming the override) when the model cannot be split this way."""
        if self.num_kv_heads % tp_size or self.num_heads % tp_size:
            raise ValueError(
                f"trainer.tp_size={tp_size} must divide the {self.num_kv_heads} KV heads and "
                f"{self.num_heads} attention heads"
            )
        if self.ffn_hidden_size % tp_size or self.padded_vocab_size % tp_size:
            raise ValueError(f"trainer.tp_size={tp_size} must divide the FFN size and padded vocab")
        if self.num_layers % pp_size:
            raise ValueError(f"trainer.pp_size={pp_size} must divide num_hidden_layers={self.num_layers}")


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """Vocab rounded up to `multiple`. Independent of TP (any TP dividing `multiple` works), so a
    checkpoint saved at one TP size loads at another."""
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(frozen=True)
class ParamMap:
    """One Megatron parameter of one pipeline stage and the HF tensors it is made of."""

    megatron_name: str  # local name, as in GPTModel.named_parameters()
    kind: Kind
    hf_names: tuple[str, ...]
    exported: bool = True  # False for the last stage's copy of a tied embedding


def stage_layers(dims: ModelDims, pp_size: int, pp_rank: int) -> range:
    """Global indices of the decoder layers held by pipeline stage `pp_rank`."""
    per_stage = dims.num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def param_maps(dims: ModelDims, *, pp_size: int, pp_rank: int, te_fused_norms: bool) -> list[ParamMap]:
    """Every parameter of one stage, in GPTModel.named_parameters() order.

    `te_fused_norms`: the TransformerEngine spec fuses the pre-attention and pre-MLP norms into
    the following linear (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`).
    """
    maps: list[ParamMap] = []
    if pp_rank == 0:
        maps.append(
            ParamMap(
                "embedding.word_embeddings.weight",
                Kind.vocab,
                ("model.embed_tokens.weight",),
            )
        )
    for local, layer in enumerate(stage_layers(dims, pp_size, pp_rank)):
        mg, hf = f"decoder.layers.{local}.", f"model.layers.{layer}."
        attn, mlp = hf + "self_attn.", hf + "mlp."
        in_norm = (
            "self_attention.linear_qkv.layer_norm_weight" if te_fused_norms else "input_layernorm.weight"
        )
        maps.append(ParamMap(mg + in_norm, Kind.replicated, (hf + "input_layernorm.weight",)))
        qkv = tuple(f"{attn}{p}_proj.weight" for p in "qkv")
        maps.append(ParamMap(mg + "self_attention.linear_qkv.weight", Kind.qkv, qkv))
        if dims.qkv_bias:
            qkv_b = tuple(f"{attn}{p}_proj.bias" for p in "qkv")
            maps.append(ParamMap(mg + "self_attention.linear_qkv.bias", Kind.qkv, qkv_b))
        maps.append(
            ParamMap(
                mg + "self_attention.linear_proj.weight",
                Kind.row,
                (attn + "o_proj.weight",),
            )
        )
        if dims.qk_norm:
            for m, h in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
                maps.append(
                    ParamMap(
                        f"{mg}self_attention.{m}.weight",
                        Kind.replicated,
                        (f"{attn}{h}.weight",),
                    )
                )
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te_fused_norms else "pre_mlp_layernorm.weight"
        maps.append(
            ParamMap(
                mg + mlp_norm,
                Kind.replicated,
                (hf + "post_attention_layernorm.weight",),
            )
        )
        gate_up = (mlp + "gate_proj.weight", mlp + "up_proj.weight")
        maps.append(ParamMap(mg + "mlp.linear_fc1.weight", Kind.gate_up, gate_up))
        maps.append(ParamMap(mg + "mlp.linear_fc2.weight", Kind.row, (mlp + "down_proj.weight",)))
    if pp_rank == pp_size - 1:
        maps.append(
            ParamMap(
                "decoder.final_layernorm.weight",
                Kind.replicated,
                ("model.norm.weight",),
            )
        )
        if not dims.tied_embeddings:
            maps.append(ParamMap("output_layer.weight", Kind.vocab, ("lm_head.weight",)))
        elif pp_size > 1:  # the last stage's copy of the tied embedding
            maps.append(
                ParamMap(
                    "output_layer.weight",
                    Kind.vocab,
                    ("model.embed_tokens.weight",),
                    False,
                )
            )
    return maps


def hf_shapes(pm: ParamMap, dims: ModelDims) -> list[tuple[int, ...]]:
    """Shapes of `pm.hf_names` in an HF checkpoint."""
    h, d = dims.hidden_size, dims.head_dim
    if pm.kind is Kind.vocab:
        return [(dims.vocab_size, h)]
    if pm.kind is Kind.qkv:
        rows = (dims.num_heads * d, dims.num_kv_heads * d, dims.num_kv_heads * d)
        bias = pm.megatron_name.endswith(".bias")
        return [(r,) if bias else (r, h) for r in rows]
    if pm.kind is Kind.gate_up:
        return [(dims.ffn_hidden_size, h)] * 2
    if pm.kind is Kind.row:
        cols = dims.num_heads * d if "linear_proj" in pm.megatron_name else dims.ffn_hidden_size
        return [(h, cols)]
    qk_norm = pm.megatron_name.endswith(("q_layernorm.weight", "k_layernorm.weight"))
    return [(d,)] if qk_norm else [(h,)]


def hf_to_full(pm: ParamMap, tensors: list[torch.Tensor], dims: ModelDims) -> torch.Tensor:
    """HF tensors -> the full (TP-unsplit) Megatron tensor."""
    if pm.kind is Kind.vocab:
        (emb,) = tensors
        pad = emb.new_zeros((dims.padded_vocab_size - emb.shape[0], *emb.shape[1:]))
        return torch.cat([emb, pad])
    if pm.kind is Kind.qkv:
        q, k, v = tensors
        g, d, rest = dims.num_kv_heads, dims.head_dim, q.shape[1:]
        grouped = [
            q.reshape(g, dims.heads_per_group * d, *rest),
            k.reshape(g, d, *rest),
            v.reshape(g, d, *rest),
        ]
        return torch.cat(grouped, dim=1).reshape(-1, *rest)
    if pm.kind is Kind.gate_up:
        return torch.cat(tensors)
    (t,) = tensors
    return t


def full_to_hf(pm: ParamMap, full: torch.Tensor, dims: ModelDims) -> list[torch.Tensor]:
    """The full Megatron tensor -> HF tensors (inverse of `hf_to_full`), as contiguous copies."""
    if pm.kind is Kind.vocab:
        return [full[: dims.vocab_size].clone()]
    if pm.kind is Kind.qkv:
        g, d, rest = dims.num_kv_heads, dims.head_dim, full.shape[1:]
        q_rows = dims.heads_per_group * d
        grouped = full.reshape(g, q_rows + 2 * d, *rest)
        q, k, v = torch.split(grouped, [q_rows, d, d], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]
    if pm.kind is Kind.gate_up:
        return [t.contiguous() for t in torch.chunk(full, 2)]
    return [full.clone()]


def split_tp(pm: ParamMap, full: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
    """The full Megatron tensor -> one shard per TP rank."""
    if pm.kind is Kind.replicated:
        return [full] * tp_size
    if pm.kind is Kind.row:
        return list(torch.chunk(full, tp_size, dim=1))
    if pm.kind is Kind.gate_up:
        gate, up = torch.chunk(full, 2)
        return [
            torch.cat(pair) for pair in zip(torch.chunk(gate, tp_size), torch.chunk(up, tp_size), strict=True)
        ]
    return list(torch.chunk(full, tp_size, dim=0))


def merge_tp(pm: ParamMap, shards: list[torch.Tensor]) -> torch.Tensor:
    """One shard per TP rank -> the full Megatron tensor (inverse of `split_tp`)."""
    if pm.kind is Kind.replicated:
        return shards[0]
    if pm.kind is Kind.row:
        return torch.cat(shards, dim=1)
    if pm.kind is Kind.gate_up:
        halves = [torch.chunk(s, 2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=0)


def hf_to_megatron_shard(
    get_hf: Callable[[str], torch.Tensor],
    dims: ModelDims,
    *,
    tp_size: int,
    tp_rank: int,
    pp_size: int,
    pp_rank: int,
    te_fused_norms: bool = False,
) -> dict[str, torch.Tensor]:
    """This rank's Megatron parameters (local names) from HF tensors fetched by name."""
    out: dict[str, torch.Tensor] = {}
    for pm in param_maps(dims, pp_size=pp_size, pp_rank=pp_rank, te_fused_norms=te_fused_norms):
        full = hf_to_full(pm, [get_hf(n) for n in pm.hf_names], dims)
        out[pm.megatron_name] = split_tp(pm, full, tp_size)[tp_rank].contiguous()
    return out
