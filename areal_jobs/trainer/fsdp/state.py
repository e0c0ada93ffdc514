"""FSDP2 wrapping, sharded checkpoints and the HF export of the FSDP backend (fsdp_backend.py).

Checkpoint layout (trainer/ in a step folder): `dcp/` is a torch.distributed.checkpoint of the
model and AdamW state, each rank writing its own shards (the same world size resumes it; DCP
reshards on load, so another dp_size loads it too); `rng-<rank>.pt` holds each rank's RNG state.
The HF export is one `model.safetensors` plus config and tokenizer files, written by rank 0 from
the full tensors every rank helped gather.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def shard(model: torch.nn.Module, mixed_precision: bool, device: torch.device | None) -> torch.nn.Module:
    """fully_shard every decoder layer (the classes transformers names in `_no_split_modules`),
    then the root (embeddings, final norm, head: tied weights stay one parameter there)."""
    if device is not None:
        model.to(device)
    mesh = init_device_mesh(device.type if device is not None else "cpu", (dist.get_world_size(),))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in blocks]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder-layer class (_no_split_modules): "
            "trainer=fsdp cannot shard it layer by layer; use trainer=torch"
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _options(adapters_only: bool) -> StateDictOptions:
    """LoRA (model.lora.rank > 0): the frozen base is model.path's; only the adapters are saved."""
    return StateDictOptions(ignore_frozen_params=adapters_only, strict=not adapters_only)


def _model_state(model: torch.nn.Module, state: dict, adapters_only: bool) -> dict:
    """ignore_frozen_params still keeps a tied head (its second name): keep trainable tensors only."""
    if not adapters_only:
        return state
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in trainable}


def save_sharded(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str, adapters_only: bool = False
) -> None:
    """Collective: every rank writes its shards of model + optimizer, and its RNG state."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(adapters_only))
    model_state = _model_state(model, model_state, adapters_only)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder / "dcp"))
    rng = {"torch_rng": torch.get_rng_state(), "numpy_rng": np.random.get_state()}
    tmp = folder / f"rng-{dist.get_rank()}.pt.tmp"
    torch.save(rng, tmp)
    tmp.replace(folder / f"rng-{dist.get_rank()}.pt")
    dist.barrier()  # the step folder is committed only once every rank has written


def load_sharded(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str, adapters_only: bool = False
) -> None:
    """Collective: the state `save_sharded` wrote, resharded to this world if it differs."""
    folder = Path(path)
    options = _options(adapters_only)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": _model_state(model, model_state, adapters_only), "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(folder / "dcp"))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=options,
    )
    rng_file = folder / f"rng-{dist.get_rank()}.pt"
    if rng_file.exists():  # a checkpoint from a smaller world has none for the extra ranks
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch_rng"])
        np.random.set_state(rng["numpy_rng"])


def write_hf(path: str, tensors: dict[str, torch.Tensor], config, architecture: str, source: str) -> None:
    """Rank 0: an HF directory transformers and the rollout engines load (`config.architectures`
    names the original class, not FSDP's wrapper subclass)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config = copy.deepcopy(config)
    config.architectures = [architecture]
    config.save_pretrained(str(folder))
    for name in TOKENIZER_FILES:
        src = Path(source) / name
        if src.exists():
            shutil.copyfile(src, folder / name)  # the run's umask, not the source's mode
