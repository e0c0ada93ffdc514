"""The FSDP backend's weights under their checkpoint names: the broadcast to the rollout engines,
the disk fallback and `final_hf` (trainer/fsdp/backend.py delegates here).

`iter_weights` is collective (each parameter's `full_tensor()` all-gather): rank 0, the one
sender, yields full tensors; the others join the gathers eagerly and yield nothing, as
Megatron's non-sender ranks do. `weight_specs` is rank 0's alone and gathers nothing.

Names: an HF checkpoint's. A tied model stores only the embedding. LoRA's adapters are merged
into their layers' weights. A mixture of experts: transformers 5 holds a layer's experts fused
in memory (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); checkpoints, vLLM
and SGLang name them per expert (`experts.{e}.gate_proj.weight`, ...). save_pretrained's own
reverse conversion (`revert_weight_conversion`, what the torch backend's export calls) gives those
names; here it runs one gathered tensor at a time (each fused tensor reverts on its own), so the
broadcast streams, and on meta tensors for the specs, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from areal_jobs.api import TensorSpec
from areal_jobs.config import LoraConfig
from areal_jobs.trainer.forward import lora as lora_adapters
from areal_jobs.trainer.objective.router_loss import has_router


def full(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor on the CPU (collective for a DTensor: an all-gather)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def _sharded_state(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # an HF checkpoint of a tied model stores only the embedding
    return list(state.items())


def _checkpoint_names(
    model: torch.nn.Module, name: str, tensor: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensor` under the checkpoint's names: itself, or a fused expert tensor split per expert."""
    if not has_router(model):
        yield name, tensor
        return
    from transformers.core_model_loading import revert_weight_conversion

    yield from revert_weight_conversion(model, {name: tensor}).items()


def weight_specs(model: torch.nn.Module, rank: int) -> list[TensorSpec]:
    """What `iter_weights` will yield, in order, on rank 0 (the sender); [] elsewhere."""
    if rank != 0:
        return []
    out = []
    for name, t in _sharded_state(model):
        if lora_adapters.is_adapter_key(name):
            continue  # merged into their layers' weights
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")  # the global shape, nothing gathered
        out += [
            TensorSpec(key, str(v.dtype).removeprefix("torch."), tuple(v.shape))
            for key, v in _checkpoint_names(model, name, meta)
        ]
    return out


def iter_weights(model: torch.nn.Module, rank: int, lora: LoraConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: every rank must call it. Rank 0 gets a generator of full tensors; the others
    join every all-gather now and get nothing."""
    gathered = ((name, full(t)) for name, t in _sharded_state(model))
    if rank != 0:
        for _ in gathered:
            pass
        return iter(())
    if lora.enabled:
        gathered = iter(lora_adapters.merged_state(dict(gathered), lora.scaling).items())
    return (item for name, t in gathered for item in _checkpoint_names(model, name, t))


def save_adapter(model: torch.nn.Module, rank: int, lora: LoraConfig, model_path: str, path: str) -> None:
    """LoRA: the adapters alone as a PEFT directory (collective: every rank joins the gathers)."""
    adapters = {name: full(t) for name, t in model.state_dict().items() if lora_adapters.is_adapter_key(name)}
    if rank == 0:
        lora_adapters.write_adapter_dir(path, adapters, lora, str(Path(model_path).resolve()))
    if dist.get_world_size() > 1:
        dist.barrier()
