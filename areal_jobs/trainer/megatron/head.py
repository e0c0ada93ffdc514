"""The Megatron backend's output layer, applied by the trainer to the final hidden states.

The GPTModel (model.HiddenStateGPTModel) stops at the final norm on the last pipeline stage; the
output layer's weight (the word embedding's when tied, this stage's copy of it under PP) is applied
here, vocab-parallel over the TP group, `trainer.logprob_chunk_tokens` output positions at a time
(trainer/forward/logprobs.py; with trainer.logprob_kernel=triton its softmax side is the fused Triton
kernels, each shard's partial statistics combined over TP), only where the next token is an output token. The padded vocabulary columns
are left out, so the softmax is over the HF vocabulary exactly; the logits are divided by the
sampling temperature. `logprob_chunk_tokens=0` keeps the full-vocabulary path as it was (every
position's `[T, V/tp]` float32 logits through Megatron's vocab_parallel_cross_entropy), to measure
against. `full_logits` (evaluation and tests only) gathers the whole `[T, V]`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel

from areal_jobs.trainer.forward.logprobs import head_logprobs
from areal_jobs.trainer.megatron.convert import ModelDims
from areal_jobs.trainer.megatron.microbatch import MicroBatch


class OutputHead:
    """Log-probs and entropy at a micro-batch's output positions from `[T, 1, H]` hidden states."""

    def __init__(
        self,
        gpt,
        dims: ModelDims,
        *,
        tp_size: int,
        tp_rank: int,
        temperature: float,
        chunk_tokens: int,
        kernel: str = "torch",
    ) -> None:
        self._gpt = gpt
        self._dims = dims
        self._per_rank = dims.padded_vocab_size // tp_size
        self._vocab_start = tp_rank * self._per_rank
        self._temperature = temperature
        self._chunk_tokens = chunk_tokens
        self.kernel = kernel  # the chunked head's softmax side: torch or triton (logprobs.resolve_kernel)

    def logprobs(
        self, hidden: torch.Tensor, mb: MicroBatch, *, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [n], entropy [n]) of the tempered policy; the entropy detached unless
        `entropy_grad`. Collective over the TP group."""
        weight = self._gpt.output_weight()
        if self._chunk_tokens == 0:
            return self._full_vocab(hidden, weight, mb, entropy_grad)
        rows = mb.out_index
        return head_logprobs(
            hidden[:, 0].index_select(0, rows),
            weight,
            mb.labels.index_select(0, rows),
            temperature=self._temperature,
            chunk_tokens=self._chunk_tokens,
            entropy_grad=entropy_grad,
            num_valid=self._dims.vocab_size,
            vocab_start=self._vocab_start,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            kernel=self.kernel,
        )

    @torch.no_grad()
    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Untempered logits over the HF vocabulary [T, V] float32, gathered over TP: the whole
        tensor, for evaluation and tests (never on the training path)."""
        local = F.linear(hidden[:, 0], self._gpt.output_weight()).float()
        return tensor_parallel.gather_from_tensor_model_parallel_region(local)[:, : self._dims.vocab_size]

    # ------------------------------------------------------------------ the path before chunking

    def _full_vocab(self, hidden, weight, mb: MicroBatch, entropy_grad: bool):
        if entropy_grad:
            raise ValueError(
                "trainer.logprob_chunk_tokens=0 (the full-vocabulary path) only reports the entropy: "
                "set trainer.logprob_chunk_tokens > 0 for an entropy gradient"
            )
        logits = self._local_logits(hidden, weight)
        entropy = self._full_vocab_entropy(logits, mb)
        # vocab_parallel_cross_entropy works in place on the logits it is given: entropy first
        nll = tensor_parallel.vocab_parallel_cross_entropy(logits[:, None], mb.labels[:, None])
        return -nll[:, 0].index_select(0, mb.out_index), entropy

    def _local_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[T, V/tp] float32 tempered logits of every position, padded columns at -inf."""
        logits = F.linear(hidden[:, 0].to(weight.dtype), weight).float()
        if self._temperature != 1.0:
            logits = logits / self._temperature
        index = torch.arange(self._per_rank, device=logits.device) + self._vocab_start
        pad = index >= self._dims.vocab_size
        return logits.masked_fill(pad, float("-inf")) if bool(pad.any()) else logits

    @torch.no_grad()
    def _full_vocab_entropy(self, logits: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """H = log Σ e^l - Σ e^l l / Σ e^l at the output positions, each sum all-reduced over TP."""
        if mb.out_index.numel() == 0:  # an empty micro-batch: its TP peers skip alike (same data)
            return torch.zeros(0, device=logits.device)
        local = logits.index_select(0, mb.out_index)  # [n, Vp/tp]
        group = parallel_state.get_tensor_model_parallel_group()
        top = local.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = local - top[:, None]
        exp = shifted.exp()
        sums = torch.stack([exp.sum(-1), (exp * shifted.masked_fill(exp == 0, 0.0)).sum(-1)])
        dist.all_reduce(sums, group=group)
        return sums[0].log() - sums[1] / sums[0]
