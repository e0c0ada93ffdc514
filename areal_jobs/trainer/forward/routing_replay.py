"""Rollout routing replay (`trainer.routing_replay=rollout`): the trainer's forward of a mixture of
experts sends each token to the experts the rollout engine sent it to.

Why: the engine and the trainer compute the router's logits with different kernels; where two
experts' scores nearly tie, the two pick different experts for the same token and the behaviour
and trainer log-probs then disagree by far more than the numerics of a dense model (arXiv
2510.11370; slime and verl ship the same remedy). Replay takes the expert *choice* from the
engine and keeps everything else the trainer's own:

- the router's probabilities are still computed by the trainer's router (softmax of its logits),
  gathered at the replayed experts and renormalised over them as the model does
  (`norm_topk_prob`), so the expert weights and the router keep their gradients;
- positions without routes (the all-ones row of transport/routes.py: a cached prompt prefix, the
  last token, padding) keep the trainer's own top-k, computed exactly as the model computes it;
- the load-balancing loss (trainer/objective/router_loss.py) reads the router logits, unchanged.

Implemented as a forward hook on each decoder layer's Hugging Face top-k router (Qwen3-MoE's
`Qwen3MoeTopKRouter` and routers of the same contract: `(logits, scores, indices)` out, `top_k`,
`num_experts`, `norm_topk_prob` attributes), over the packed, padding-free row: the router sees the
row's tokens in order, which is the order of the packed routes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from areal_jobs.trainer.forward.layer_compile import hf_decoder_layers
from areal_jobs.trainer.intake.batch import TrainSample
from areal_jobs.transport.routes import scored_coverage


def replay_topk(
    router_logits: torch.Tensor,
    own_indices: torch.Tensor,
    replayed: torch.Tensor,
    num_experts: int,
    norm_topk_prob: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [T, k] in the logits' dtype, indices [T, k] int64) of a top-k softmax router that
    routes row t to `replayed[t]` where that row names experts (every id < num_experts) and to
    `own_indices[t]` (the router's own top-k) elsewhere. Differentiable in `router_logits`."""
    if replayed.shape != own_indices.shape:
        raise ValueError(
            f"replayed routes {tuple(replayed.shape)} do not match the router's top-k {tuple(own_indices.shape)}: "
            "the engine served another model (set trainer.routing_replay=off)"
        )
    replayed = replayed.to(own_indices.device, torch.int64)
    valid = (replayed < num_experts).all(dim=-1, keepdim=True)
    indices = torch.where(valid, replayed, own_indices.to(torch.int64))
    probs = torch.softmax(router_logits, dtype=torch.float, dim=-1)
    scores = probs.gather(-1, indices)
    if norm_topk_prob:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores.to(router_logits.dtype), indices


def routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, its top-k router) for every sparse layer of a transformers MoE."""
    out = []
    for index, layer in enumerate(hf_decoder_layers(model)):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and all(hasattr(gate, a) for a in ("top_k", "num_experts", "norm_topk_prob")):
            out.append((index, gate))
    return out


@contextmanager
def replayed_routes(model: torch.nn.Module, routes: np.ndarray | None) -> Iterator[int]:
    """Within the block every forward of `model` routes the packed row's tokens as `routes`
    ([T, layers, top_k] over the row; None: no change) says. Yields the number of rows replayed."""
    if routes is None:
        yield 0
        return
    found = routers(model)
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no top-k router to replay routes into (a dense model): "
            "set trainer.routing_replay=off"
        )
    if routes.shape[1] <= max(index for index, _ in found):
        raise ValueError(f"routes cover {routes.shape[1]} layers; the model has sparse layer {found[-1][0]}")
    table = torch.from_numpy(np.ascontiguousarray(routes).astype(np.int64))
    handles = []
    for index, gate in found:

        def hook(module, args, output, layer=index):
            logits, _, own = output
            if logits.shape[0] != table.shape[0]:
                raise ValueError(f"routes for {table.shape[0]} tokens, the router saw {logits.shape[0]}")
            scores, indices = replay_topk(
                logits, own, table[:, layer], module.num_experts, module.norm_topk_prob
            )
            return logits, scores, indices

        handles.append(gate.register_forward_hook(hook))
    try:
        yield int((table < int(found[0][1].num_experts)).all(-1).any(-1).sum())
    finally:
        for handle in handles:
            handle.remove()


def replay_token_fraction(samples: list[TrainSample]) -> float:
    """`train/routing_replay_token_fraction`, on every backend: the share of output tokens
    predicted through replayed experts (1 - the last token's share when the engine reported
    every position)."""
    covered = sum(scored_coverage(s.routes, s.num_prompt_tokens)[0] for s in samples)
    return covered / max(sum(s.num_output_tokens for s in samples), 1)


def require_routers(has_routers: bool, model_path: str) -> None:
    """trainer.routing_replay=rollout on a model without a top-k router: refused at setup, on
    every backend, naming the override."""
    if not has_routers:
        raise ValueError(
            f"trainer.routing_replay=rollout: {model_path} is dense (no top-k router to replay into); "
            "set trainer.routing_replay=off"
        )
