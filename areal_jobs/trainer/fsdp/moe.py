"""Mixtures of experts on the FSDP backend: the router's load-balancing loss across DP ranks.

What each rank's loss is computed over: each micro-batch's own routed tokens, on the rank that
runs it. The forward of a packed micro-batch returns transformers' balancing loss over that
row's tokens (trainer/objective/router_loss.py: E x sum_e f_e P_e, f_e and P_e pooled over the
layers); the rank adds it to the micro-batch's policy loss weighted by the micro-batch's share of
the whole minibatch's tokens (every rank's samples, known to all ranks from the broadcast batch),
so the weights of all ranks' micro-batches of a minibatch sum to 1. FSDP averages the gradients
over the ranks and each rank scales its loss by the world size (backend.py), so the reduced
gradient is that of the token-weighted mean over every micro-batch of the minibatch: the torch
backend's definition (router_loss.RouterLoss), computed over the DP plan's micro-batches.

Why not one balancing loss over the rank's whole share, or over the global minibatch (f_e and
P_e all-reduced, Megatron's `global` load balancing): the torch backend, transformers and
Megatron's default (`aux_loss`) count per micro-batch, and the pooled statistics would need an
all-reduce inside every layer's forward of every micro-batch.

Consequence: the loss is not linear in the tokens (products of per-micro-batch shares), so its
value depends on how the minibatch is split into micro-batches. At 1 rank the DP plan's
micro-batches are the torch backend's (intake/dp_plan.py packs the one share as
`balanced_microbatches` packs the minibatch): the same loss and step. At N ranks the plan first
splits the minibatch into N token-balanced shares, then packs each: where the torch backend
would pack the minibatch into exactly N micro-batches, those are the same N groups (the same
longest-first assignment) and the step is the torch backend's; otherwise the micro-batches, and
so the balancing loss, differ by design (tests/integration/fsdp/test_fsdp_moe.py, docs/moe.md).
The policy loss is unaffected (a token mean over the minibatch, split any way).

Logged: `train/router_aux_loss`, the same token-weighted mean over every rank's micro-batches
(the weighted sums are all-reduced), and `train/router_aux_loss_coef`.
"""

from __future__ import annotations

from collections.abc import Callable

from areal_jobs.trainer.objective.router_loss import RouterLoss


def router_metrics_over_ranks(
    router: RouterLoss, sum_over_ranks: Callable[[list[float]], list[float]]
) -> dict:
    """`router.metrics()` over every rank's micro-batches (collective: every rank calls it)."""
    weighted, weights = sum_over_ranks([router.weighted_sum, router.weight_sum])
    if not weights:
        return {}
    return {"train/router_aux_loss": weighted / weights, "train/router_aux_loss_coef": router.coef}
