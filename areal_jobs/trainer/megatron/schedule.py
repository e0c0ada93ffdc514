"""Megatron's forward/backward schedule over our packed micro-batches, and what it calls on the
last pipeline stage: the PPO loss, forward-only log-probs, and the reduction of their statistics.

Megatron's schedule owns the pipeline (1F1B with PP > 1, a plain loop without): it calls
`forward_step` once per micro-batch and, on the last stage, the loss function with that stage's
hidden states; every loss function here returns Megatron's triple (loss, token count, report).
With `calculate_per_token_loss` Megatron leaves the loss unscaled: each micro-batch's loss is
already divided by its minibatch's output-token count (trainer/objective/loss.py), so gradients sum.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from areal_jobs.config import AlgoConfig
from areal_jobs.trainer.megatron.head import OutputHead
from areal_jobs.trainer.megatron.microbatch import MicroBatch
from areal_jobs.trainer.megatron.routing_replay import RouteReplay
from areal_jobs.trainer.objective.loss import LossStats, ppo_loss, pre_step_logp


def run_schedule(
    model: torch.nn.Module,
    microbatches: list[MicroBatch],
    loss_fn,
    *,
    forward_only: bool,
    fp32_output: bool,
    replay: RouteReplay | None = None,
) -> list[dict]:
    """One pass of `microbatches` through `model`; the last stage's reports, one per micro-batch
    (an empty list on the other stages). `fp32_output=False` keeps a bf16 model's last hidden
    states in bf16 (Float16Module would upcast them to fp32 before the head). `replay`: `model`'s
    routing replay slots, given each micro-batch's routes before its forward."""
    extra = {} if fp32_output else {"fp32_output": False}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        if replay is not None:
            replay.use(mb.routes)
        output = model(
            mb.input_ids,
            mb.position_ids,
            mb.attention_mask,
            packed_seq_params=mb.packed_seq_params,
            **extra,
        )
        return output, partial(loss_fn, mb)

    if replay is not None:
        replay.start(forward_only=forward_only)
    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches),
            model=[model],
            num_microbatches=len(microbatches),
            seq_length=max(mb.num_tokens for mb in microbatches),  # ignored with variable lengths
            micro_batch_size=1,
            forward_only=forward_only,
        )
    finally:
        if replay is not None:  # no later forward replays a stale row
            replay.use(None)


def _no_loss(hidden: torch.Tensor, report: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    return hidden.new_zeros(()), torch.tensor(0, dtype=torch.int), report


def logp_loss(head: OutputHead, mb: MicroBatch, hidden: torch.Tensor):
    """Forward-only: the output tokens' log-probs under the model whose last layer is `head`."""
    logp, _ = head.logprobs(hidden, mb)
    return _no_loss(hidden, {"logp": logp.detach()})


def logits_loss(head: OutputHead, mb: MicroBatch, hidden: torch.Tensor):
    """Forward-only: untempered logits over the HF vocab (evaluation and tests)."""
    return _no_loss(hidden, {"logits": head.full_logits(hidden)})


@torch.no_grad()
def forward_logp(
    model: torch.nn.Module,
    head: OutputHead,
    microbatches: list[MicroBatch],
    *,
    fp32_output: bool,
    replay: RouteReplay | None = None,
) -> list[tuple[MicroBatch, torch.Tensor]]:
    """Forward-only log-probs of the output tokens under `model`, as (micro-batch, [n]) pairs on
    the last pipeline stage (none on the others)."""
    outputs = run_schedule(
        model,
        microbatches,
        partial(logp_loss, head),
        forward_only=True,
        fp32_output=fp32_output,
        replay=replay,
    )
    return list(zip(microbatches, (out["logp"] for out in outputs), strict=False))


def ppo_step_loss(head: OutputHead, algo: AlgoConfig, mb: MicroBatch, hidden: torch.Tensor):
    """The decoupled PPO loss of one micro-batch (trainer/objective/loss.py), with gradient."""
    logp, entropy = head.logprobs(hidden, mb, entropy_grad=algo.entropy_coef > 0)
    first_minibatch = mb.prox_logp is None or mb.first_minibatch
    if mb.prox_logp is None:  # prox_logp=current: these are the pre-step weights' log-probs
        mb.prox_logp = logp.detach()
    loss, stats = ppo_loss(
        logp,
        mb.prox_logp,
        mb.behav_logp,
        mb.advantages,
        mb.token_weight,
        mb.seq_index,
        algo,
        entropy=entropy,
        ref_logp=mb.ref_logp,
        pre_logp=pre_step_logp(algo, mb.prox_logp, logp, first_minibatch),
    )
    return loss, torch.tensor(int(stats.num_tokens), dtype=torch.int), {"loss": loss.detach(), "stats": stats}


def step_stats(outputs: list[dict]) -> LossStats:
    """The LossStats of one optimiser step's micro-batches that this rank counts (the last stage's
    TP-rank-0 ranks, as reduce_metrics; empty elsewhere), for algo.ess_step."""
    stats = LossStats()
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
        for out in outputs:
            stats.add(out["stats"])
    return stats


def sum_over_ranks(values: list[float], *, device: torch.device | None) -> list[float]:
    """Sums over every rank (collective), on `device` (the backend's, as reduce_metrics)."""
    row = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(row)
    return row.tolist()


def reduce_metrics(
    outputs: list[dict],
    microbatches: list[MicroBatch],
    *,
    num_global_tokens: float,
    device: torch.device | None,
) -> dict[str, float]:
    """Loss and PPO statistics of the last stage, summed over DP ranks onto global rank 0.
    Collective: every rank calls it; only the last stage's TP-rank-0 ranks contribute."""
    stats = LossStats()
    loss = prox_gap = 0.0
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
        for out, mb in zip(outputs, microbatches, strict=True):
            stats.add(out["stats"])
            loss += float(out["loss"])
            prox_gap += float((mb.prox_logp - mb.behav_logp).abs().sum())
    values = np.concatenate([[loss, prox_gap], stats.sums()])
    totals = torch.tensor(values, dtype=torch.float64, device=device)
    maxes = torch.tensor(stats.maxes(), dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)  # |log w| is >= 0: idle ranks' zeros do not win
    summed = LossStats.from_reduced(totals[2:].cpu().numpy(), maxes.cpu().numpy())
    return {
        "train/loss": float(totals[0]),
        "train/prox_behav_abs_diff": float(totals[1]) / num_global_tokens,
        **summed.to_metrics(),
    }
