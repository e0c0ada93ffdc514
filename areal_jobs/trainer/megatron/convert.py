"""Hugging Face <-> Megatron-Core state-dict adapter for the Llama, Qwen2, Qwen3 and Qwen3-MoE families.

Pure tensor code (torch only, no megatron, no distributed), so every rule is unit-testable.
Shapes: h hidden, f ffn, d head_dim, n_q attention heads, n_g KV heads (query groups),
q = n_q / n_g query heads per group, V vocab, Vp padded vocab.

  HF q_proj [n_q*d, h], k_proj / v_proj [n_g*d, h]
      -> Megatron linear_qkv [n_g*(q+2)*d, h]: per group, its q query heads, its key, its value
  HF gate_proj / up_proj [f, h] -> Megatron linear_fc1 [2f, h]; TP rank r holds [gate_r; up_r]
  HF embed_tokens / lm_head [V, h] -> [Vp, h], padded with zero rows (see `padded_vocab_size`)
  Qwen3-MoE (E experts of ffn size m): HF mlp.gate [E, h] -> the router `mlp.router.weight`
      (replicated); expert e's gate_proj / up_proj / down_proj -> `mlp.experts.local_experts.{i}.
      linear_fc1` [2m, h] / `linear_fc2` [h, m] (SequentialMLP: grouped GEMM off), on expert-parallel
      rank e // (E / ep) as its local expert i = e % (E / ep); each expert split over the expert-TP
      ranks as a dense MLP is over TP

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
from dataclasses import dataclass, replace
from typing import Any

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")


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
    o_bias: bool = False  # attention_bias (Llama, Qwen3, Qwen3-MoE): o_proj has a bias too
    # mixture of experts (Qwen3-MoE): every layer's MLP is `num_experts` experts, `moe_topk` per token
    num_experts: int = 0  # 0 = dense
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = False  # the top-k weights renormalised to sum to 1
    router_aux_loss_coef: float = 0.0  # the model config's load-balancing weight

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], *, vocab_multiple: int = 128) -> ModelDims:
        """Parse an HF config.json dict; raises ValueError for features the adapter lacks."""
        family = cfg.get("model_type", "")
        if family not in FAMILIES:
            raise ValueError(f"trainer=megatron supports model_type {FAMILIES}, got {family!r}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg.get('hidden_act')!r} is not supported (only silu)")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias is not supported by trainer=megatron")
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported by trainer=megatron")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope scaling {rope} is not supported by trainer=megatron")
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        vocab = int(cfg["vocab_size"])
        attention_bias = bool(cfg.get("attention_bias")) and family != "qwen2"
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
            qkv_bias=family == "qwen2" or attention_bias,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            o_bias=attention_bias,
            **(_moe_fields(cfg) if family == "qwen3_moe" else {}),
        )

    def check_layout(self, tp_size: int, pp_size: int, ep_size: int = 1, expert_tp_size: int = 1) -> None:
        """Raise ValueError (naming the override) when the model cannot be split this way."""
        if not self.is_moe and ep_size * expert_tp_size > 1:
            raise ValueError(
                f"trainer.ep_size={ep_size} / trainer.expert_tp_size={expert_tp_size}: the model is dense "
                "(no experts); set both to 1"
            )
        if self.is_moe and tp_size > 1:
            # megatron-core's MoE layer raises in training when TP > 1 runs without sequence
            # parallelism, which the trainer does not turn on (the local spec's norms reject it)
            raise ValueError(
                f"trainer.tp_size={tp_size} with a mixture of experts: Megatron's MoE layer trains under tensor "
                "parallelism only with sequence parallelism, which trainer=megatron does not enable; set "
                "trainer.tp_size=1 and split with trainer.ep_size, trainer.pp_size and trainer.dp_size"
            )
        if self.is_moe and self.num_experts % ep_size:
            raise ValueError(f"trainer.ep_size={ep_size} must divide the model's {self.num_experts} experts")
        if self.is_moe and self.moe_ffn_hidden_size % expert_tp_size:
            raise ValueError(
                f"trainer.expert_tp_size={expert_tp_size} must divide moe_intermediate_size="
                f"{self.moe_ffn_hidden_size}"
            )
        if self.num_kv_heads % tp_size or self.num_heads % tp_size:
            raise ValueError(
                f"trainer.tp_size={tp_size} must divide the {self.num_kv_heads} KV heads and "
                f"{self.num_heads} attention heads"
            )
        if self.ffn_hidden_size % tp_size or self.padded_vocab_size % tp_size:
            raise ValueError(f"trainer.tp_size={tp_size} must divide the FFN size and padded vocab")
        if self.num_layers % pp_size:
            raise ValueError(f"trainer.pp_size={pp_size} must divide num_hidden_layers={self.num_layers}")


def _moe_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """ModelDims' expert fields from a Qwen3-MoE config; refuses what the adapter does not map."""
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(
            "trainer=megatron maps Qwen3-MoE models whose every layer is sparse: mlp_only_layers="
            f"{cfg.get('mlp_only_layers')}, decoder_sparse_step={cfg.get('decoder_sparse_step')} are not supported"
        )
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError("shared experts are not supported by trainer=megatron (Qwen3-MoE has none)")
    return dict(
        num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),
        moe_topk=int(cfg["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
    )


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
    expert: int | None = None  # a routed expert's weight: its global index (split over EP and expert TP)


def expert_name(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def experts_per_rank(dims: ModelDims, ep_size: int) -> int:
    return dims.num_experts // ep_size


def ep_peer(pm: ParamMap, dims: ModelDims, ep_size: int, ep_rank: int) -> ParamMap:
    """`pm` (an expert's weight) as expert-parallel rank `ep_rank` holds it: the same local
    Megatron name, the HF names of that rank's expert in the same local slot."""
    assert pm.expert is not None, pm
    local = pm.expert % experts_per_rank(dims, ep_size)
    expert = ep_rank * experts_per_rank(dims, ep_size) + local
    layer = int(pm.hf_names[0].split(".")[2])
    projs = ("gate_proj", "up_proj") if pm.kind is Kind.gate_up else ("down_proj",)
    return replace(pm, hf_names=tuple(expert_name(layer, expert, p) for p in projs), expert=expert)


def stage_layers(dims: ModelDims, pp_size: int, pp_rank: int) -> range:
    """Global indices of the decoder layers held by pipeline stage `pp_rank`."""
    per_stage = dims.num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def param_maps(
    dims: ModelDims, *, pp_size: int, pp_rank: int, te_fused_norms: bool, ep_size: int = 1, ep_rank: int = 0
) -> list[ParamMap]:
    """Every parameter of one stage (and, for an MoE, of one expert-parallel rank's experts), in
    GPTModel.named_parameters() order.

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
        if dims.o_bias:  # row-parallel: the bias is added once, after the reduction
            maps.append(
                ParamMap(mg + "self_attention.linear_proj.bias", Kind.replicated, (attn + "o_proj.bias",))
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
        # an MoE layer's norm stays a module of its own under TE too (no linear to fuse it into)
        fused_mlp_norm = te_fused_norms and not dims.is_moe
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if fused_mlp_norm else "pre_mlp_layernorm.weight"
        maps.append(
            ParamMap(
                mg + mlp_norm,
                Kind.replicated,
                (hf + "post_attention_layernorm.weight",),
            )
        )
        if dims.is_moe:
            maps += _expert_maps(dims, mg, layer, ep_size, ep_rank)
            continue
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


def _expert_maps(dims: ModelDims, mg: str, layer: int, ep_size: int, ep_rank: int) -> list[ParamMap]:
    """One MoE layer's router and this expert-parallel rank's experts."""
    maps = [ParamMap(mg + "mlp.router.weight", Kind.replicated, (f"model.layers.{layer}.mlp.gate.weight",))]
    per_rank = experts_per_rank(dims, ep_size)
    for local in range(per_rank):
        expert = ep_rank * per_rank + local
        fc = f"{mg}mlp.experts.local_experts.{local}."
        gate_up = (expert_name(layer, expert, "gate_proj"), expert_name(layer, expert, "up_proj"))
        maps.append(ParamMap(fc + "linear_fc1.weight", Kind.gate_up, gate_up, expert=expert))
        maps.append(
            ParamMap(
                fc + "linear_fc2.weight", Kind.row, (expert_name(layer, expert, "down_proj"),), expert=expert
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
    ffn = dims.moe_ffn_hidden_size if pm.expert is not None else dims.ffn_hidden_size
    if pm.kind is Kind.gate_up:
        return [(ffn, h)] * 2
    if pm.kind is Kind.row:
        cols = dims.num_heads * d if "linear_proj" in pm.megatron_name else ffn
        return [(h, cols)]
    if pm.megatron_name.endswith("mlp.router.weight"):
        return [(dims.num_experts, h)]
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
    ep_size: int = 1,
    ep_rank: int = 0,
    expert_tp_size: int = 1,
    expert_tp_rank: int = 0,
) -> dict[str, torch.Tensor]:
    """This rank's Megatron parameters (local names) from HF tensors fetched by name: dense
    weights split over TP, experts' over expert TP."""
    out: dict[str, torch.Tensor] = {}
    maps = param_maps(
        dims,
        pp_size=pp_size,
        pp_rank=pp_rank,
        te_fused_norms=te_fused_norms,
        ep_size=ep_size,
        ep_rank=ep_rank,
    )
    for pm in maps:
        full = hf_to_full(pm, [get_hf(n) for n in pm.hf_names], dims)
        size, rank = (expert_tp_size, expert_tp_rank) if pm.expert is not None else (tp_size, tp_rank)
        out[pm.megatron_name] = split_tp(pm, full, size)[rank].contiguous()
    return out
