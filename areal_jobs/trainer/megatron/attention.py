"""Core attention of Megatron's local (non-TransformerEngine) layer spec, every `trainer.attention`.

Megatron's stock local `DotProductAttention` materialises [b, heads, s, s] scores, repeats K/V per
query group and refuses packed sequences (`PackedSeqParams` is TransformerEngine's). This module
takes its place in `get_gpt_layer_local_spec` (model.py) with the same constructor, so TP-sharded
heads, GQA groups and the softmax scale come from Megatron's own bookkeeping, and computes:
  - varlen: the micro-batch arrives as THD `PackedSeqParams` (microbatch.py), as it would for TE.
    Megatron's SelfAttention then drops the batch dimension (query [t, heads, d], key/value
    [t, groups, d]) and applies RoPE per sequence from cu_seqlens, so positions restart at 0 as
    in Hugging Face; each sequence attends causally to itself (trainer/forward/attention.py): Σ lᵢ²
    compute, no [T, T] mask. Returns [t, heads * d] (SelfAttention restores [t, 1, hidden]).
  - varlen_attn, flex (CUDA): the same THD micro-batch through torch's FlashAttention varlen
    kernel or compiled FlexAttention with a document mask built once per micro-batch
    (trainer/forward/packed_attention.py), every layer sharing it.
  - dense: query [s, b, heads, d] with a bool [b, 1, s, s] block-diagonal causal mask (True =
    masked), through torch's fused scaled_dot_product_attention. On CPU the stock version took
    2.8x as long as the fused kernel for a train step of the built-in model.
Megatron's selective recompute (`trainer.recompute=selective`: recompute_modules=["core_attn"])
wraps whatever module sits here, so it recomputes this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

from areal_jobs.config import Attention
from areal_jobs.trainer.forward.attention import packed_causal_attention
from areal_jobs.trainer.forward.packed_attention import layout_of


class PackedCoreAttention(DotProductAttention):
    """Drop-in for the local spec's `core_attention`: THD packed (varlen, varlen_attn, flex: `kind`,
    a ModuleSpec param) or dense-masked."""

    def __init__(self, *args, kind: Attention = Attention.varlen, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kind = kind

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if attention_bias is not None:
            raise ValueError("attention bias needs the TransformerEngine spec")
        dropout_p = self.config.attention_dropout if self.training else 0.0
        if packed_seq_params is not None:
            return self._varlen(query, key, value, packed_seq_params, dropout_p)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if attention_mask is None else ~attention_mask,
            is_causal=attention_mask is None,
            dropout_p=dropout_p,
            scale=self.softmax_scale,
            enable_gqa=True,
        )
        return context.permute(2, 0, 1, 3).reshape(
            query.shape[0], query.shape[1], self.hidden_size_per_partition
        )

    def _varlen(self, query, key, value, params, dropout_p: float):
        if params.qkv_format != "thd" or query.dim() != 3:
            raise ValueError(
                f"packed attention takes THD PackedSeqParams (query [t, heads, d]), got "
                f"qkv_format={params.qkv_format!r} and query {tuple(query.shape)}"
            )
        if params.cu_seqlens_kv is not None and params.cu_seqlens_kv is not params.cu_seqlens_q:
            if not bool((params.cu_seqlens_kv == params.cu_seqlens_q).all()):
                raise ValueError("self-attention: cu_seqlens_q and cu_seqlens_kv must be equal")
        context = _packed(query, key, value, params.cu_seqlens_q, self.kind, self.softmax_scale, dropout_p)
        return context.view(query.shape[0], self.hidden_size_per_partition)  # [t, heads, d] -> [t, heads * d]


@torch.compiler.disable  # trainer.compile: the boundaries are Python ints; compiled kernels inside
def _packed(query, key, value, cu_seqlens, kind: Attention, scale, dropout_p):
    """query [t, heads, d], key/value [t, groups, d] (Megatron's THD layout) -> [t, heads, d]."""
    return packed_causal_attention(
        query, key, value, layout_of(cu_seqlens), kind, scale=scale, dropout_p=dropout_p
    )
