"""Attention over a packed micro-batch without a [T, T] mask (`trainer.attention=varlen`).

A micro-batch is one row of T tokens holding several sequences (trainer/intake/packing.py) with boundaries
cu_seqlens = [0, l1, l1 + l2, ..., T]. The dense path gives the kernel one block-diagonal causal
mask over the row: T² memory for the mask, T² compute. Here torch's fused
scaled_dot_product_attention runs once per sequence with `is_causal`: compute Σ lᵢ², and beyond
q, k, v only what the kernel itself keeps (the flash kernels, on CPU and CUDA, keep the output and
the log-sum-exp). Exact: each query sees the same keys; only the kernel's summation order differs.

Why per-sequence SDPA, also on GPU, rather than FlexAttention with a document-causal block mask:
one code path on CPU (where it is tested) and CUDA; no compilation per packed shape (a new length
every micro-batch); on CUDA, SDPA takes its flash kernel for each sequence (GQA included). RL
micro-batches hold few sequences of hundreds to tens of thousands of tokens, so one kernel launch
per sequence and layer is small next to the layer's matmuls. (Not measured on a GPU yet.)

On CUDA two kernels take the whole row at once (trainer/forward/packed_attention.py):
`trainer.attention=varlen_attn` (torch's FlashAttention-2 varlen kernel) and `flex` (compiled
FlexAttention with a document-causal block mask). `packed_causal_attention` dispatches to the
three; each is exact against the others up to the kernels' summation order.

Two users:
  - Megatron's local layer spec (trainer/megatron/attention.py), fed THD `PackedSeqParams`;
  - the Hugging Face models of the torch and FSDP2 backends: `hf_attn_implementation` registers
    `hf_varlen_attention` with transformers' AttentionInterface as `areal_varlen` (and as
    `areal_varlen_attn` / `areal_flex` for the CUDA kernels). transformers
    builds no mask for a name missing from its AttentionMaskInterface (masking_utils.
    _preprocess_mask_arguments returns None for it), so no [T, T] tensor exists on the way
    either. `packed_forward_kwargs` hands the boundaries to the model as `cu_seq_lens_q`;
    without them they come from the position ids, which restart at 0 for each sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import torch.nn.functional as F

from areal_jobs.config import Attention
from areal_jobs.trainer.forward import packed_attention
from areal_jobs.trainer.forward.packed_attention import PackedLayout, layout_of

HF_VARLEN = "areal_varlen"  # the attn_implementation name of hf_varlen_attention
# transformers' attn_implementation name of each packed kind (all three: hf_varlen_attention)
HF_NAMES = {
    Attention.varlen: HF_VARLEN,
    Attention.varlen_attn: "areal_varlen_attn",
    Attention.flex: "areal_flex",
}


def causal_attention_per_sequence(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: Sequence[int],
    *,
    scale: float | None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """query [heads, T, d], key/value [groups, T, d] (heads a multiple of groups: GQA) -> the
    context [T, heads, d], contiguous (token-major, as both callers project it next): sequence i
    (tokens bounds[i]:bounds[i + 1]) attends causally to itself only."""
    if bounds[0] != 0 or bounds[-1] != query.shape[-2]:
        raise ValueError(
            f"sequence bounds {bounds[0]}..{bounds[-1]} do not cover the {query.shape[-2]} tokens"
        )
    # 4-D [1, heads, l, d]: the fused (flash) kernels, on CPU as on CUDA, take only 4-D inputs;
    # given 3-D ones SDPA falls back to its math path, which keeps the [heads, l, l] probabilities
    q, k, v = query[None], key[None], value[None]
    outputs = [
        F.scaled_dot_product_attention(
            q[:, :, start:end],
            k[:, :, start:end],
            v[:, :, start:end],
            is_causal=True,
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=key.shape[0] != query.shape[0],
        )[0].transpose(0, 1)  # [l, heads, d]
        for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        if end > start
    ]
    return torch.cat(outputs)  # one copy, token-major


def bounds_of(cu_seqlens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> list[int]:
    """Sequence boundaries [0, ..., T] from cu_seqlens, else from position ids [1, T] that restart
    at 0 for each sequence (the packing convention). Read once per tensor (packed_attention.layout_of):
    every layer of one forward gets the same one, so a CUDA tensor costs one sync per forward."""
    return layout_of(cu_seqlens, position_ids).bounds


def packed_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: PackedLayout,
    kind: Attention,
    *,
    scale: float | None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """query [T, heads, d], key/value [T, groups, d] (token-major) -> [T, heads, d] contiguous: each
    sequence of `layout` attends causally to itself, by `trainer.attention` (varlen, varlen_attn, flex)."""
    if kind is Attention.varlen:
        return causal_attention_per_sequence(
            query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), layout.bounds,
            scale=scale, dropout_p=dropout_p,
        )  # fmt: skip
    if dropout_p:
        raise ValueError(
            f"trainer.attention={kind.value} has no attention dropout: set trainer.attention=varlen"
        )
    if kind is Attention.varlen_attn:  # its output takes q's strides: Megatron views it flat
        return packed_attention.varlen_attn_packed(query, key, value, layout, scale=scale).contiguous()
    if kind is Attention.flex:
        return packed_attention.flex_attention_packed(query, key, value, layout, scale=scale)
    raise ValueError(f"trainer.attention={kind.value} is not a packed attention kernel")


@torch.compiler.disable  # trainer.compile: the boundaries are Python ints; compiled kernels inside
def hf_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    kind: Attention = Attention.varlen,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, heads, T, d], key/value [1, groups, T, d] ->
    ([1, T, heads, d], no weights), as its sdpa implementation returns them. `kind`: the kernel
    (bound per registered name, HF_NAMES)."""
    if query.shape[0] != 1:
        raise ValueError(
            f"attn_implementation={HF_VARLEN} attends within one packed row (batch 1), got batch "
            f"{query.shape[0]}: pack the sequences (trainer/intake/packing.py) or load the model with sdpa"
        )
    if key.shape[-2] != query.shape[-2]:
        # model.generate's decode step on the trainer's model (evaluation, the tests' greedy
        # references): one new token of one unpadded sequence attends to every cached key
        if query.shape[-2] != 1 or attention_mask is not None:
            raise ValueError(
                f"attn_implementation={HF_VARLEN} decodes one token of one unpadded sequence at a time "
                f"with a KV cache (got {query.shape[-2]} query tokens): load the model with sdpa"
            )
        out = F.scaled_dot_product_attention(
            query, key, value, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
        )
        return out.transpose(1, 2).contiguous(), None
    if kwargs.get("sliding_window") is not None:
        raise ValueError(
            f"attn_implementation={HF_VARLEN} has no sliding window: set trainer.attention=dense"
        )
    if attention_mask is not None:  # transformers builds none for this name; a caller's would be ignored
        raise ValueError(
            f"attn_implementation={HF_VARLEN} takes the sequences from cu_seq_lens_q, not a mask"
        )
    layout = layout_of(kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids"))
    out = packed_causal_attention(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), layout, kind,
        scale=scaling, dropout_p=dropout,
    )  # fmt: skip
    return out[None], None


def hf_attn_implementation(attention: Attention) -> str:
    """The `attn_implementation` to load a transformers model with for `trainer.attention` (the
    backends refuse the CUDA-only kinds on CPU first: packed_attention.check_attention_device)."""
    if attention is Attention.dense:
        return "sdpa"  # transformers builds the block-diagonal mask from the restarting position ids
    from transformers import AttentionInterface

    for kind, name in HF_NAMES.items():
        AttentionInterface.register(name, partial(hf_varlen_attention, kind=kind))
    return HF_NAMES[attention]


def packed_forward_kwargs(model: torch.nn.Module, cu_seqlens: Sequence[int]) -> dict[str, object]:
    """Extra forward kwargs for a packed row: the boundaries for the varlen attention ({} for other
    attention implementations, which do not read them)."""
    if getattr(model.config, "_attn_implementation", None) not in HF_NAMES.values():
        return {}
    return {"cu_seq_lens_q": torch.as_tensor(cu_seqlens, dtype=torch.int64)}
