"""The router's load-balancing loss of a mixture-of-experts policy (`trainer.router_aux_loss_coef`).

A transformers MoE (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE: their configs carry
`router_aux_loss_coef`) computes Switch Transformer's balancing loss when its forward is asked for
router logits (`output_router_logits=True`): over all rows it routed, E * sum_e f_e * P_e, with f_e
the share of the top-k assignments expert e received and P_e its mean router probability, both
pooled over the layers; perfectly even routing scores top_k (2.0 for top-2). The forward passes
its `attention_mask` to it so that padding does not count; a packed, padding-free row has none and
every row is a real token, so nothing is excluded and nothing needs to be: prompt and answer
tokens alike, as the servers route them. The loss is per micro-batch (its own counts), as
transformers and Megatron's per-micro-batch `aux_loss` compute it, not over the global batch.

The weight: the model config's `router_aux_loss_coef` unless the trainer sets one (0 turns it off;
the value is still logged as `train/router_aux_loss`, the router's balance). A dense model has no
router: a weight > 0 for it is refused, naming the override.
"""

from __future__ import annotations

import torch


def has_router(model: torch.nn.Module) -> bool:
    """Whether `model` is a transformers mixture of experts with a balancing loss."""
    return hasattr(getattr(model, "config", None), "router_aux_loss_coef")


def resolve_coef(model: torch.nn.Module, configured: float | None) -> float:
    """trainer.router_aux_loss_coef for `model`: None = its config's weight (0 for a dense model)."""
    if not has_router(model):
        if configured:
            raise ValueError(
                f"trainer.router_aux_loss_coef={configured}: {type(model).__name__} is dense (no router "
                "in its config); set trainer.router_aux_loss_coef=null or 0"
            )
        return 0.0
    return float(model.config.router_aux_loss_coef if configured is None else configured)


class RouterLoss:
    """Collects the balancing loss of each micro-batch's forward (hf_logprobs.final_hidden_states
    appends it to `losses` when given this object) and weights it into the step's loss."""

    def __init__(self, coef: float) -> None:
        self.coef = coef
        self.losses: list[torch.Tensor] = []
        self.weighted_sum = 0.0  # sum of weight * value over the step's micro-batches
        self.weight_sum = 0.0

    def take(self, weight: float) -> torch.Tensor:
        """The term to add to this micro-batch's loss (coef * weight * its balancing loss; a zero
        tensor when coef is 0), where `weight` is the micro-batch's share of its minibatch's
        routed tokens: the weights of a minibatch sum to 1, the terms to its token-weighted mean."""
        assert len(self.losses) == 1, f"expected one forward's balancing loss, got {len(self.losses)}"
        value = self.losses.pop()
        self.weighted_sum += weight * float(value.detach())
        self.weight_sum += weight
        return value * (self.coef * weight) if self.coef else value.new_zeros(())

    def metrics(self) -> dict[str, float]:
        if not self.weight_sum:
            return {}
        return {
            "train/router_aux_loss": self.weighted_sum / self.weight_sum,
            "train/router_aux_loss_coef": self.coef,
        }
