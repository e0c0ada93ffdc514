"""One packed micro-batch of the Megatron backend: the samples of a DP rank's share, in one row.

The sequences' boundaries travel as THD PackedSeqParams (cu_seqlens), read by TransformerEngine's
attention or, on the local spec, by ours (attention.py, `trainer.attention=varlen`); or, with
`trainer.attention=dense` on the local spec, as one block-diagonal causal [T, T] mask. Either way
each sequence attends to itself only, positions restarting at 0 each. Pure tensor building, no
model: the backend runs it through Megatron's schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from areal_jobs.trainer.intake.batch import TrainSample
from areal_jobs.trainer.intake.packing import pack
from areal_jobs.trainer.megatron.routing_replay import packed_routes


@dataclass
class MicroBatch:
    """One packed micro-batch of this DP rank. T tokens in one row, n output tokens."""

    input_ids: torch.Tensor  # int64 [1, T]
    position_ids: torch.Tensor  # int64 [1, T], restarting at 0 per sequence
    labels: torch.Tensor  # int64 [T]: the next token in the row
    out_index: torch.Tensor  # int64 [n]: positions whose next token is an output token
    behav_logp: torch.Tensor  # float32 [n]
    advantages: torch.Tensor  # float32 [n]
    token_weight: torch.Tensor  # float32 [n]: the loss aggregation weight, 0 on masked tokens
    seq_index: torch.Tensor  # int64 [n]: which sample of the micro-batch each output token is from
    attention_mask: torch.Tensor | None  # bool [1, 1, T, T], True = masked (dense attention)
    packed_seq_params: PackedSeqParams | None  # THD (varlen attention, TE or ours)
    prox_logp: torch.Tensor | None = None  # float32 [n]: before the gradient pass, or in it (current)
    ref_logp: torch.Tensor | None = None  # float32 [n]: the reference model's (algo.kl_coef > 0)
    first_minibatch: bool = False  # its gradient pass runs the pre-step weights (offpolicy/* stats)
    routes: torch.Tensor | None = None  # int64 [T, layers, top_k]: replayed experts (routing_replay.py)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def build_microbatch(
    samples: list[TrainSample],
    agg: list[np.ndarray] | None = None,
    *,
    device: torch.device | None,
    thd: bool,
    replay: bool = False,
) -> MicroBatch:
    """Pack `samples` into one row; `agg` are their loss-aggregation weights (trainer/objective/loss.py).
    `thd`: boundaries as PackedSeqParams, else a dense mask. An empty list gives a one-token
    dummy: every DP rank runs the same number of micro-batches. `replay`
    (trainer.routing_replay=rollout): the samples' expert routes packed as the row's tokens."""
    dev = device
    if not samples:  # an empty micro-batch keeps every DP rank's schedule the same length
        seqs, prompts = [np.zeros(1, dtype=np.int64)], [1]
    else:
        seqs, prompts = (
            [s.input_ids for s in samples],
            [s.num_prompt_tokens for s in samples],
        )
    packed = pack(seqs)
    starts = packed.cu_seqlens[:-1]
    out_index = np.concatenate(
        [np.arange(s + p - 1, s + len(q) - 1) for s, p, q in zip(starts, prompts, seqs, strict=True)]
    ).astype(np.int64)
    n = int(out_index.shape[0])
    behav = np.concatenate([s.behav_logprobs for s in samples]) if samples else np.zeros(0, np.float32)
    adv = (
        np.concatenate([np.full(s.num_output_tokens, s.advantage, np.float32) for s in samples])
        if samples
        else behav
    )
    weight = np.concatenate(agg) if samples and agg is not None else np.zeros(n, np.float64)
    seq_index = np.repeat(np.arange(len(samples)), [s.num_output_tokens for s in samples])
    ids = torch.as_tensor(packed.input_ids, device=dev)
    mask, psp = None, None
    if thd:
        cu = torch.as_tensor(packed.cu_seqlens, dtype=torch.int32, device=dev)
        longest = int(np.diff(packed.cu_seqlens).max())
        psp = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
    else:
        lengths = torch.as_tensor(np.diff(packed.cu_seqlens), device=dev)
        segment = torch.repeat_interleave(torch.arange(len(seqs), device=dev), lengths)
        causal = torch.ones(len(ids), len(ids), dtype=torch.bool, device=dev).tril()
        mask = ~((segment[:, None] == segment[None, :]) & causal)[None, None]
    return MicroBatch(
        input_ids=ids[None],
        position_ids=torch.as_tensor(packed.position_ids, device=dev)[None],
        labels=torch.roll(ids, -1),
        out_index=torch.as_tensor(out_index, device=dev),
        behav_logp=torch.as_tensor(behav, dtype=torch.float32, device=dev),
        advantages=torch.as_tensor(adv, dtype=torch.float32, device=dev),
        token_weight=torch.as_tensor(weight, dtype=torch.float32, device=dev),
        seq_index=torch.as_tensor(seq_index, dtype=torch.int64, device=dev),
        attention_mask=mask,
        packed_seq_params=psp,
        routes=packed_routes([s.routes for s in samples], [len(q) for q in seqs], dev)
        if replay and samples
        else None,
    )
