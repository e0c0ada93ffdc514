"""Rollout routing replay (`trainer.routing_replay=rollout`) in Megatron-Core's MoE layers: each
token goes to the experts the rollout engine sent it to (docs/moe.md, trainer/forward/routing_replay.py
for the torch trainer and why).

Megatron-Core 0.16 has a hook for this: `TopKRouter.router_replay` (moe/router_replay.py), which
`topk_routing_with_score_function` asks for the top-k instead of `torch.topk`. Its own RouterReplay
replays whole tables only (no "this position has no route"), keeps its instances in a process-wide
list (the frozen reference model's routers and every earlier model's would be in it) and needs a
global action switched around the backward. `ReplayedTopk` fills the same slot with the torch
trainer's semantics:

- where a position's row names experts (every id < num_experts) those experts are taken; the
  weights are the router's own scores gathered there: logits then softmax over the k (Megatron
  without `moe_router_pre_softmax` = HF `norm_topk_prob`: the renormalised probabilities) or the
  softmax over all experts (pre-softmax = no renormalisation), so the router keeps its gradient;
- positions without routes (the all-ones row of transport/routes.py) keep the router's own top-k.

The routes of a micro-batch are its packed row's (microbatch.py packs them as the tokens, no
padding; Megatron's router sees the row's [T, 1] tokens in order: no sequence parallelism). Each
router reads its own layer's column (`layer_number` is global, pipeline offset included), so a
pipeline stage uses only its layers' routes; with expert parallelism the router runs before the
dispatch, on the rank's own tokens. `RouteReplay.use` sets the row before each forward of a
micro-batch (schedule.run_schedule). With `trainer.recompute=full` a gradient pass runs each
layer's forward twice: checkpointed, without grad, then again in the backward, with grad; with
pp_size > 1 1F1B runs later micro-batches' forwards in between, so the row set then is another
micro-batch's. Each slot therefore queues the rows of its checkpointed forwards and the recompute
takes them back in order (a stage's backwards run in its forwards' order).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import torch

from areal_jobs.config import Recompute, RoutingReplay, TrainerConfig
from areal_jobs.trainer.forward.routing_replay import require_routers
from areal_jobs.transport.routes import pack


class ReplayedTopk:
    """Stands in `TopKRouter.router_replay` of one MoE layer (0-based global `layer`)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.table: torch.Tensor | None = None  # [T, top_k] expert ids of the row; None = own top-k
        self.recomputed = False  # this pass's forwards run again in its backward (recompute=full)
        self.pending: deque[torch.Tensor | None] = deque()  # rows of forwards not recomputed yet

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron's call: (scores at the chosen experts [T, k], their ids [T, k] int64)."""
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        table = self.table
        if self.recomputed:
            if not torch.is_grad_enabled():  # the checkpointed forward: its recompute comes later
                self.pending.append(table)
            elif self.pending:  # the recompute in the backward: the row its forward had
                table = self.pending.popleft()
        if table is None:
            return values, own
        return replay_choice(scores, own, table, self.layer)


def replay_choice(
    scores: torch.Tensor, own: torch.Tensor, replayed: torch.Tensor, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `replayed` [T, k] that name experts (every id < the score columns) replace `own`;
    `scores` [T, E] gathered at the result. Differentiable in `scores`."""
    if replayed.shape != own.shape:
        raise ValueError(
            f"layer {layer}: replayed routes {tuple(replayed.shape)} do not match the router's top-k "
            f"{tuple(own.shape)} over the micro-batch's tokens: the engine served another model "
            "(set trainer.routing_replay=off)"
        )
    replayed = replayed.to(own.device, torch.int64)
    valid = (replayed < scores.shape[-1]).all(dim=-1, keepdim=True)
    indices = torch.where(valid, replayed, own)
    return scores.gather(1, indices), indices


class RouteReplay:
    """The replay slots of one GPTModel's MoE layers (this pipeline stage's)."""

    def __init__(self, model: torch.nn.Module, *, recompute_full: bool = False) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.recompute_full = recompute_full
        self.slots: list[ReplayedTopk] = []
        for module in model.modules():
            if isinstance(module, TopKRouter):
                if module.config.moe_router_fusion:  # the fused kernel never asks the slot
                    raise ValueError("routing replay needs moe_router_fusion=False (megatron/model.py)")
                module.router_replay = ReplayedTopk(int(module.layer_number) - 1)
                self.slots.append(module.router_replay)

    def start(self, *, forward_only: bool) -> None:
        """Before a schedule: nothing queued, no row set; a gradient pass under
        trainer.recompute=full queues its forwards' rows for the recompute."""
        for slot in self.slots:
            slot.table, slot.recomputed = None, self.recompute_full and not forward_only
            slot.pending.clear()

    def use(self, routes: torch.Tensor | None) -> None:
        """The next forward routes its row as `routes` [T, layers, top_k] (None: its own top-k)."""
        for slot in self.slots:
            if routes is not None and routes.shape[1] <= slot.layer:
                raise ValueError(
                    f"routes cover {routes.shape[1]} layers; the model has MoE layer {slot.layer}: the engine "
                    "served another model (set trainer.routing_replay=off)"
                )
            slot.table = None if routes is None else routes[:, slot.layer]


def for_model(
    cfg: TrainerConfig, is_moe: bool, model: torch.nn.Module, model_path: str
) -> RouteReplay | None:
    """The policy's replay slots under trainer.routing_replay=rollout (None when off); refuses a
    dense model."""
    if cfg.routing_replay is not RoutingReplay.rollout:
        return None
    require_routers(is_moe, model_path)
    return RouteReplay(model, recompute_full=cfg.recompute is Recompute.full)


def packed_routes(
    routes: Sequence[np.ndarray | None], lengths: Sequence[int], device: torch.device | None
) -> torch.Tensor | None:
    """Per-sample routes laid out as the micro-batch's packed row of `lengths` (transport/routes.py
    `pack`), on `device` as int64; None where no sample of the row has routes. The "no route" value
    stays what it was (255 / 65535): above every expert id, as route_dtype chose the dtype."""
    row = pack(routes, lengths)
    return None if row is None else torch.as_tensor(row.astype(np.int64), device=device)
