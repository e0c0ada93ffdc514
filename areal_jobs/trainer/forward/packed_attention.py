"""The CUDA attention kernels for a packed row: `trainer.attention=varlen_attn` and `flex`.

Both take the whole micro-batch at once from its sequence boundaries (cu_seqlens), where the
default `varlen` calls SDPA once per sequence (trainer/forward/attention.py):

  - varlen_attn: `torch.nn.attention.varlen.varlen_attn`, FlashAttention-2 inside libtorch, causal
    as `window_size=(-1, 0)`. CUDA only (libtorch has no CPU kernel for it). Its GQA flag came in torch 2.12; before it, K and V are repeated to
    every query head (a copy per layer).
  - flex: `flex_attention` with a document-causal BlockMask (token q sees kv iff same sequence and
    kv <= q). The mask is built once per micro-batch, straight from the boundaries at block level
    (`document_block_mask`: which 128 x 128 tiles are empty, full or partial; no [T, T] tensor),
    and shared by every layer. The row is padded to a multiple of `FLEX_BUCKET_TOKENS` (the padding
    is a sequence of its own, so no row is empty), which bounds the shapes the compiled kernel
    sees; torch.compile's automatic dynamic shapes then cover the rest. On CUDA the compiled
    kernel runs; on CPU flex_attention runs uncompiled and forward only (it materialises the
    scores and has no CPU backward): the unit tests check the forward and the mask there.

The trainers refuse both on CPU (`check_attention_device`, naming the override).

`PackedLayout` holds what a micro-batch's layers share (the boundaries, their device copy, the
block mask): `layout_of` returns the same object for every layer of one forward.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

FLEX_BLOCK = 128  # flex_attention's default tile (its BlockMask granularity)
FLEX_BUCKET_TOKENS = 512  # packed lengths are padded to a multiple of this (verl's bucket)


@dataclass
class PackedLayout:
    """One packed row's sequences: bounds [0, l1, l1 + l2, ..., T] and device copies made once."""

    bounds: list[int]
    _cache: dict = field(default_factory=dict)

    @property
    def max_len(self) -> int:
        return max((b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])), default=0)

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        key = ("cu", str(device))
        if key not in self._cache:
            self._cache[key] = torch.tensor(self.bounds, dtype=torch.int32, device=device)
        return self._cache[key]

    def block_mask(self, device: torch.device):
        key = ("mask", str(device))
        if key not in self._cache:
            self._cache[key] = document_block_mask(self.bounds, bucket_length(self.bounds[-1]), device)
        return self._cache[key]


_last: tuple[weakref.ref, PackedLayout] | None = None


def layout_of(
    cu_seqlens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
) -> PackedLayout:
    """The row's layout from cu_seqlens, else from position ids [1, T] that restart at 0 for each
    sequence (the packing convention). Every layer of one forward passes the same tensor: it is
    read (one device sync for a CUDA tensor) and its layout built once."""
    global _last
    source = cu_seqlens if cu_seqlens is not None else position_ids
    if source is None:
        raise ValueError("packed attention needs cu_seq_lens_q or position_ids to find the sequences")
    if _last is not None and _last[0]() is source:
        return _last[1]
    if cu_seqlens is not None:
        bounds = [int(b) for b in cu_seqlens.tolist()]
    else:
        if position_ids.dim() != 2 or position_ids.shape[0] != 1:
            raise ValueError(
                f"packed attention runs one packed row: position_ids {tuple(position_ids.shape)}"
            )
        starts = torch.nonzero(position_ids[0] == 0).flatten().tolist()
        bounds = sorted({0, *starts}) + [int(position_ids.shape[1])]
    layout = PackedLayout(bounds)
    _last = (weakref.ref(source), layout)
    return layout


def bucket_length(tokens: int, multiple: int = FLEX_BUCKET_TOKENS) -> int:
    """The padded row length flex attention runs at: the next multiple of `multiple`."""
    return max(multiple, -(-tokens // multiple) * multiple)


def document_ids(bounds: Sequence[int], padded_len: int, device=None) -> torch.Tensor:
    """int32 [padded_len]: sequence i's tokens are i; the padding after bounds[-1] is one more."""
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])] + [padded_len - bounds[-1]]
    if lengths[-1] < 0:
        raise ValueError(f"padded length {padded_len} is shorter than the row ({bounds[-1]} tokens)")
    ids = torch.arange(len(lengths), dtype=torch.int32, device=device)
    return ids.repeat_interleave(torch.tensor(lengths, device=device))


def document_block_tiles(doc: torch.Tensor, block: int = FLEX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) bool [nb, nb] over (query tile, key tile) of the document-causal mask, from
    the document ids (non-decreasing, length a multiple of `block`). Tile j <= i has an allowed
    pair iff key tile j's last document reaches query tile i's first (documents are contiguous);
    j < i is full iff both tiles hold one and the same document."""
    if doc.numel() % block:
        raise ValueError(f"row of {doc.numel()} tokens is not a multiple of the {block}-token tile")
    first, last = doc[::block], doc[block - 1 :: block]
    i = torch.arange(first.numel(), device=doc.device)[:, None]
    j = i.T
    any_pair = (j <= i) & (last[None, :] >= first[:, None])
    full = (j < i) & (first[None, :] == last[:, None])
    return any_pair & ~full, full


def document_block_mask(bounds: Sequence[int], padded_len: int, device, block: int = FLEX_BLOCK):
    """flex_attention's BlockMask of the document-causal mask of a packed row padded to
    `padded_len`, for every batch and head (B = H = 1, broadcast)."""
    from torch.nn.attention.flex_attention import BlockMask

    doc = document_ids(bounds, padded_len, device)
    partial, full = document_block_tiles(doc, block)

    def indices(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = tiles.sum(1, dtype=torch.int32)
        order = torch.argsort(tiles.to(torch.int8), dim=1, descending=True, stable=True)
        return counts[None, None], order.to(torch.int32)[None, None]

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    kv_num, kv_idx = indices(partial)
    full_num, full_idx = indices(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=document_causal,
        seq_lengths=(padded_len, padded_len),
    )  # fmt: skip


def check_attention_device(attention: str, device: torch.device | None) -> None:
    """varlen_attn and flex train on CUDA only (libtorch has no CPU varlen kernel; FlexAttention
    no CPU backward): refuse them elsewhere, naming the override."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if attention in ("varlen_attn", "flex") and not on_cuda:
        why = (
            "FlashAttention varlen kernel"
            if attention == "varlen_attn"
            else "FlexAttention (no CPU backward)"
        )
        raise ValueError(
            f"trainer.attention={attention} is torch's {why}, CUDA only: on CPU set "
            "trainer.attention=varlen (per-sequence SDPA, the default)"
        )


_flex_compiled = None


def flex_attention_packed(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: PackedLayout, *, scale
) -> torch.Tensor:
    """query [T, heads, d], key/value [T, groups, d] -> [T, heads, d] contiguous."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention

    tokens = query.shape[0]
    padded = bucket_length(tokens)
    mask = layout.block_mask(query.device)

    def to_bhtd(t: torch.Tensor) -> torch.Tensor:  # [T, h, d] -> [1, h, padded, d]
        return torch.nn.functional.pad(t, (0, 0, 0, 0, 0, padded - tokens)).transpose(0, 1)[None]

    if query.is_cuda:
        if _flex_compiled is None:
            _flex_compiled = torch.compile(flex_attention)
        run = _flex_compiled
    else:  # uncompiled: the scores are materialised (CPU tests)
        run = flex_attention
    out = run(
        to_bhtd(query), to_bhtd(key), to_bhtd(value), block_mask=mask, scale=scale,
        enable_gqa=key.shape[1] != query.shape[1],
    )  # fmt: skip
    return out[0, :, :tokens].transpose(0, 1).contiguous()


def varlen_attn_packed(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: PackedLayout, *, scale
) -> torch.Tensor:
    """query [T, heads, d], key/value [T, groups, d] -> [T, heads, d], one FlashAttention-2 call."""
    from torch.nn.attention.varlen import varlen_attn

    check_attention_device("varlen_attn", query.device)
    args, kwargs = varlen_attn_arguments(query, key, value, layout, scale, varlen_attn)
    return varlen_attn(*args, **kwargs)


def varlen_attn_arguments(query, key, value, layout: PackedLayout, scale, fn) -> tuple[tuple, dict]:
    """The arguments of `fn` (torch's varlen_attn, whose keywords changed across versions) for
    causal attention within each sequence of `layout`."""
    params = inspect.signature(fn).parameters
    kwargs = {"scale": scale}
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # torch < 2.12: every query head gets its own copy of its group's K and V
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal (torch 2.11+: a tuple)
    else:
        kwargs["is_causal"] = True
    cu = layout.cu_seqlens(query.device)
    return (query, key, value, cu, cu, layout.max_len, layout.max_len), kwargs
