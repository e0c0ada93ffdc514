"""The router's load-balancing loss on the Megatron backend (`trainer.router_aux_loss_coef`).

Megatron's own loss ("aux_loss" in its router, megatron/model.py `moe_settings`), not the torch
backend's transformers definition (trainer/objective/router_loss.py), and the two differ:
  transformers: pooled over the layers, E * sum_e F_e * P_e with F_e the share of all layers'
                top-k assignments and P_e the mean probability over all layers; balanced = top_k;
  Megatron:     per layer, E * sum_e f_e * P_e with f_e = count_e / (T * top_k); balanced = 1;
                the layers' losses summed.
The weight is the same knob (null = the model config's router_aux_loss_coef, 0 = off) and it is
weighted like the torch backend's: each micro-batch's loss by its share of the minibatch's routed
tokens (`per_token_coef`: Megatron scales a micro-batch's loss by its token count under
calculate_per_token_loss). The logged `train/router_aux_loss` is Megatron's per-layer loss averaged
over the layers and micro-batches, times top_k, so balanced routing scores top_k on both backends;
with the weight 0 Megatron does not compute it and nothing is logged.
"""

from __future__ import annotations

from megatron.core.transformer.moe import moe_utils

from areal_jobs.trainer.megatron.convert import ModelDims

_TRACKED = "load_balancing_loss"  # the name Megatron's router logs its loss under


def resolve_router_coef(dims: ModelDims, configured: float | None) -> float:
    """trainer.router_aux_loss_coef for `dims`, by the torch backend's rule (router_loss.resolve_coef):
    None = the model config's weight; a weight > 0 for a dense model is refused."""
    if not dims.is_moe:
        if configured:
            raise ValueError(
                f"trainer.router_aux_loss_coef={configured}: the model is dense (no router); "
                "set trainer.router_aux_loss_coef=null or 0"
            )
        return 0.0
    return dims.router_aux_loss_coef if configured is None else float(configured)


def per_token_coef(coef: float, minibatch_tokens: int) -> float:
    """Megatron's moe_aux_loss_coeff for one minibatch: its micro-batches' losses (each scaled by
    its own token count) then sum to the token-weighted mean the torch backend takes."""
    return coef / max(minibatch_tokens, 1)


def clear_tracked() -> None:
    moe_utils.clear_aux_losses_tracker()


def tracked_sum() -> float:
    """This rank's sum of its layers' unweighted losses over the micro-batches since `clear_tracked`."""
    entry = moe_utils.get_moe_layer_wise_logging_tracker().get(_TRACKED)
    return float(entry["values"].sum()) if entry else 0.0


def logged_value(total: float, dims: ModelDims, *, tp_size: int, dp_size: int, microbatches: int) -> float:
    """`train/router_aux_loss` from `tracked_sum` summed over every rank: the TP ranks hold the
    same routers (divide out), the PP stages different layers, the DP ranks `microbatches` each."""
    return total / (tp_size * dp_size * microbatches * dims.num_layers) * dims.moe_topk
