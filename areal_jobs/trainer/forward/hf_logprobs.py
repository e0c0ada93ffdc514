"""Log-probs from a Hugging Face causal LM: one packed forward, then the chunked LM head.

Shared by the torch and FSDP2 backends (and the tests' and benches' reference log-probs). The
model runs with its head handed zero positions (`final_hidden_states`): the head's weight and the
final hidden states go to trainer/forward/logprobs.py's chunked head, so no `[T, V]` logits tensor exists
(`trainer.logprob_chunk_tokens=0` keeps the full-vocabulary path to measure against).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from areal_jobs.trainer.forward.attention import packed_forward_kwargs
from areal_jobs.trainer.forward.logprobs import head_logprobs
from areal_jobs.trainer.forward.routing_replay import replayed_routes
from areal_jobs.trainer.intake.batch import TrainSample
from areal_jobs.trainer.intake.packing import pack
from areal_jobs.trainer.objective.router_loss import RouterLoss
from areal_jobs.transport.routes import pack as pack_routes


def token_logprobs(
    model: torch.nn.Module,
    samples: list[TrainSample],
    device: torch.device | None = None,
    *,
    with_entropy: bool = False,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    entropy_grad: bool = False,
    kernel: str = "torch",
    router: RouterLoss | None = None,
    replay: bool = False,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Log-probs of every output token of every sample under `model` at `temperature`, from one
    packed forward.

    Returns one float32 tensor [n_i] per sample (differentiable if grad is enabled), on `device`
    (the FSDP backend's GPU; None = CPU); with `with_entropy` also the policy's entropy at each of
    those positions, detached unless `entropy_grad` (algo.entropy_coef > 0: a loss term). The LM
    head runs `chunk_tokens` output positions at a time (trainer/forward/logprobs.py); 0 = the path before
    chunking (`_full_vocab`); `kernel` its softmax side ("torch" or "triton", logprobs.resolve_kernel).
    `router` (a mixture of experts): the forward's router load-balancing loss is appended to
    `router.losses` (trainer/objective/router_loss.py). `replay` (trainer.routing_replay=rollout):
    the samples' expert routes replace the router's top-k where they exist
    (trainer/forward/routing_replay.py).
    """
    packed = pack([s.input_ids for s in samples])
    input_ids = torch.from_numpy(packed.input_ids).unsqueeze(0).to(device)
    position_ids = torch.from_numpy(packed.position_ids).unsqueeze(0).to(device)
    boundaries = packed_forward_kwargs(model, packed.cu_seqlens)  # varlen attention's sequences
    router_losses = router.losses if router is not None else None
    routes = pack_routes([s.routes for s in samples], [len(s.input_ids) for s in samples]) if replay else None
    with replayed_routes(model, routes):
        hidden, weight = final_hidden_states(model, input_ids, position_ids, router_losses, **boundaries)
    logp, entropy = packed_head_logprobs(
        hidden, weight, input_ids[0], samples, packed.cu_seqlens[:-1].tolist(),
        temperature=temperature, chunk_tokens=chunk_tokens, entropy_grad=entropy_grad, kernel=kernel,
    )  # fmt: skip
    return (logp, entropy) if with_entropy else logp


def packed_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    samples: list[TrainSample],
    starts: list[int],
    *,
    temperature: float,
    chunk_tokens: int,
    entropy_grad: bool = False,
    kernel: str = "torch",
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The LM-head half of token_logprobs: hidden states [T, H] of a packed row `ids` [T] (sample
    i starting at starts[i]) -> per sample (log-probs [n_i], entropies [n_i]) of its outputs."""
    if chunk_tokens == 0:
        return _full_vocab(hidden, weight, ids, samples, starts, temperature, entropy_grad)
    # hidden state at position t predicts token t + 1: a sample's outputs start at its prompt length
    rows = torch.from_numpy(
        np.concatenate(
            [np.zeros(0, np.int64)]
            + [
                np.arange(a + s.num_prompt_tokens - 1, a + len(s.input_ids) - 1)
                for s, a in zip(samples, starts)
            ]
        )
    ).to(ids.device)
    logp, entropy = head_logprobs(
        hidden.index_select(0, rows),
        weight,
        ids.index_select(0, rows + 1),
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        entropy_grad=entropy_grad,
        kernel=kernel,
    )
    sizes = [s.num_output_tokens for s in samples]
    return list(logp.split(sizes)), list(entropy.split(sizes))


def _full_vocab(hidden, weight, ids, samples, starts, temperature, entropy_grad):
    """trainer.logprob_chunk_tokens=0: the algorithm before chunking, kept to measure against
    (its memory included): float32 logits of every position [T, V], a log-softmax per sample."""
    logits = F.linear(hidden, weight).float()
    if temperature != 1.0:
        logits = logits / temperature
    out, entropies = [], []
    for s, start in zip(samples, starts):
        first, last = start + s.num_prompt_tokens - 1, start + len(s.input_ids) - 1
        logp = torch.log_softmax(logits[first:last], dim=-1)
        out.append(logp.gather(-1, ids[first + 1 : last + 1, None]).squeeze(-1))
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropies.append(-(logp.exp() * logp).sum(-1))
    return out, entropies


# config attributes of HF models whose forward changes the logits after the LM head
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def final_hidden_states(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    router_losses: list[torch.Tensor] | None = None,
    **forward_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states [T, H], LM-head weight [V, H]) from one forward of the whole HF causal LM.

    The whole model runs (under FSDP2 the root's hooks unshard and reduce its parameters, the
    tied head included), but its head is handed zero positions: what it would have multiplied is
    taken on the way in, so no logits exist. The weight is the one the head holds during that
    forward (FSDP2's unsharded parameter; the root keeps it unsharded until its backward ends).
    `router_losses` (a mixture of experts): the forward also returns its router's load-balancing
    loss over the row's tokens (no attention mask: a packed row has no padding), appended there.
    """
    head = model.get_output_embeddings()
    config = getattr(model, "config", None)
    transforms = [k for k in _LOGIT_TRANSFORMS if getattr(config, k, None) not in (None, 1, 1.0)]
    if head is None or getattr(head, "bias", None) is not None or transforms:
        raise ValueError(
            f"{type(model).__name__}: the trainer computes log-probs from the LM head's weight alone; "
            f"this model's head has a bias or transforms its logits ({transforms}): not supported"
        )
    seen: dict[str, torch.Tensor] = {}

    def take(module: torch.nn.Module, args: tuple) -> tuple:
        seen["hidden"], seen["weight"] = args[0], module.weight
        return (args[0][:, :0],)

    handle = head.register_forward_pre_hook(take)
    try:
        if router_losses is not None:
            forward_kwargs["output_router_logits"] = True
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **forward_kwargs)
        if router_losses is not None:
            router_losses.append(out.aux_loss)
    finally:
        handle.remove()
    return seen["hidden"][0], seen["weight"]


def enable_layer_recompute(model: torch.nn.Module) -> None:
    """trainer.recompute=full on a transformers model: each decoder layer keeps only its input
    and runs again in backward (non-reentrant checkpointing: no input needs requires_grad)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
