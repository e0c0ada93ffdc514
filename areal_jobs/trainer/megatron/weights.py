"""Weights in and out of the Megatron model: HF safetensors in, HF-named tensors and directories
out, and Megatron dist checkpoints of model + distributed optimizer.

HF -> Megatron: each rank reads only the HF tensors its own TP/PP shard needs (lazily, by name)
and the adapter in megatron_convert.py lays them out. Megatron -> HF: each exported parameter
is all-gathered over the TP group, merged and converted; the stage's TP rank 0 yields it.
Dist checkpoints store the optimizer state in model space (`fully_reshardable`), so a
checkpoint saved at one TP/PP/DP layout loads at another.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from safetensors import safe_open
from safetensors.torch import save_file

from areal_jobs.api import TensorSpec
from areal_jobs.config import Attention
from areal_jobs.trainer.megatron.convert import (
    ModelDims,
    ParamMap,
    full_to_hf,
    hf_shapes,
    hf_to_megatron_shard,
    merge_tp,
    param_maps,
)
from areal_jobs.trainer.megatron.model import build_gpt

# model-space optimizer state: reloadable at another TP/PP/DP layout (dp_reshardable is DP-only)
_OPTIM_CKPT_META = {"distrib_optim_sharding_type": "fully_reshardable"}


class SafetensorsReader:
    """Lazy HF tensor reads by name over a (possibly sharded) safetensors checkpoint."""

    def __init__(self, model_path: str) -> None:
        root = Path(model_path)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: root / f for name, f in weight_map.items()}
        else:
            self._files = {}
            for path in sorted(root.glob("*.safetensors")):
                with safe_open(str(path), "pt") as f:
                    names = f.keys()  # a safe_open handle is not iterable
                    self._files.update(dict.fromkeys(names, path))
        if not self._files:
            raise ValueError(
                f"no safetensors weights in {model_path}: model.path must be an HF model directory"
            )

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise KeyError(f"{name} is not in the checkpoint")
        with safe_open(str(self._files[name]), "pt") as f:
            return f.get_tensor(name)


def load_hf_weights(
    gpt: torch.nn.Module,
    model_path: str,
    dims: ModelDims,
    *,
    tp_size: int,
    tp_rank: int,
    pp_size: int,
    pp_rank: int,
    te_fused_norms: bool,
) -> None:
    """Copy this rank's shard of the HF checkpoint into the (unwrapped) GPTModel."""
    shard = hf_to_megatron_shard(
        SafetensorsReader(model_path).get,
        dims,
        tp_size=tp_size,
        tp_rank=tp_rank,
        pp_size=pp_size,
        pp_rank=pp_rank,
        te_fused_norms=te_fused_norms,
    )
    params = dict(gpt.named_parameters())
    if set(params) != set(shard):
        raise RuntimeError(
            f"HF adapter and GPTModel disagree on parameters: {sorted(set(params) ^ set(shard))}"
        )
    with torch.no_grad():
        for name, param in params.items():
            if param.shape != shard[name].shape:
                raise RuntimeError(
                    f"{name}: model shape {tuple(param.shape)}, adapter {tuple(shard[name].shape)}"
                )
            param.copy_(shard[name])


def load_gpt(dims: ModelDims, config, model_path: str, *, tp_size: int, tp_rank: int, pp_size: int,
             pp_rank: int, use_te: bool, attention: Attention = Attention.varlen) -> torch.nn.Module:  # fmt: skip
    """This stage's GPTModel built from `config` with the HF weights (its TP shards)."""
    gpt = build_gpt(dims, config, use_te=use_te, attention=attention)
    load_hf_weights(
        gpt, model_path, dims, tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank,
        te_fused_norms=use_te,
    )  # fmt: skip
    return gpt


def hf_specs(maps: list[ParamMap], dims: ModelDims, dtype: torch.dtype) -> list[TensorSpec]:
    """HF name, dtype and shape of every tensor `gathered_hf_tensors` yields, in its order."""
    dtype_name = str(dtype).removeprefix("torch.")
    return [
        TensorSpec(name=name, dtype=dtype_name, shape=shape)
        for pm in maps
        for name, shape in zip(pm.hf_names, hf_shapes(pm, dims), strict=True)
    ]


def gathered_hf_tensors(
    gpt: torch.nn.Module,
    maps: list[ParamMap],
    dims: ModelDims,
    dtype: torch.dtype,
    tp_size: int,
    tp_rank: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors of `maps`; every TP rank must iterate (all-gathers), TP rank 0 gets them."""
    params = dict(gpt.named_parameters())
    group = parallel_state.get_tensor_model_parallel_group()
    for pm in maps:
        local = params[pm.megatron_name].detach()
        if tp_size > 1:
            shards = [torch.empty_like(local) for _ in range(tp_size)]
            dist.all_gather(shards, local.contiguous(), group=group)
            full = merge_tp(pm, shards)
        else:
            full = local
        if tp_rank == 0:
            for name, tensor in zip(pm.hf_names, full_to_hf(pm, full, dims), strict=True):
                yield name, tensor.to(dtype)


def hf_shard_name(pp_rank: int, pp_size: int) -> str:
    return f"model-{pp_rank + 1:05d}-of-{pp_size:05d}.safetensors"


def write_hf_metadata(
    out: Path, model_path: str, dims: ModelDims, dtype: torch.dtype, *, pp_size: int, te_fused_norms: bool
) -> None:
    """Everything of an HF directory but the weights: the source's config (dtype updated),
    tokenizer and generation files, and the index mapping each tensor to its stage's shard."""
    src = Path(model_path)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copyfile(f, out / f.name)  # the run's umask, not the source's mode
    cfg = json.loads((src / "config.json").read_text())
    for key in ("torch_dtype", "dtype"):
        if key in cfg:
            cfg[key] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    weight_map = {
        name: hf_shard_name(stage, pp_size)
        for stage in range(pp_size)
        for pm in param_maps(dims, pp_size=pp_size, pp_rank=stage, te_fused_norms=te_fused_norms)
        if pm.exported
        for name in pm.hf_names
    }
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save_hf_dir(
    out: Path,
    iter_weights: Callable[[], Iterator[tuple[str, torch.Tensor]]],
    pp_rank: int,
    pp_size: int,
    model_path: str,
    dims: ModelDims,
    dtype: torch.dtype,
    *,
    te_fused_norms: bool,
) -> None:
    """Collective: each stage's sender writes its safetensors shard (`iter_weights` yields nothing
    on the other ranks), rank 0 the config, tokenizer files and the shard index."""
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    tensors = {name: t.cpu().contiguous() for name, t in iter_weights()}
    if tensors:
        save_file(tensors, str(out / hf_shard_name(pp_rank, pp_size)), metadata={"format": "pt"})
    if dist.get_rank() == 0:
        write_hf_metadata(out, model_path, dims, dtype, pp_size=pp_size, te_fused_norms=te_fused_norms)
    dist.barrier()


def _checkpoint_state(gpt: torch.nn.Module, optimizer, *, is_loading: bool) -> dict:
    model_sd = gpt.sharded_state_dict()
    optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPTIM_CKPT_META)
    return {"model": model_sd, "optimizer": optim_sd}


def save_dist_checkpoint(gpt: torch.nn.Module, optimizer, path: str) -> None:
    """Model + distributed-optimizer state as a torch_dist checkpoint. Collective."""
    if dist.get_rank() == 0:
        Path(path).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_checkpoint_state(gpt, optimizer, is_loading=False), path)
    dist.barrier()


def load_dist_checkpoint(gpt: torch.nn.Module, optimizer, path: str) -> None:
    """Load a `save_dist_checkpoint` directory, whatever layout wrote it. Collective."""
    # A torch AdamW that never stepped has no state ("step" included), which the distributed
    # optimizer's state_dict needs: one zero-gradient step creates it; the load overwrites
    # everything that step touched (moments, step count, parameters).
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()
    state = dist_checkpointing.load(_checkpoint_state(gpt, optimizer, is_loading=True), path)
    gpt.load_state_dict(state["model"])
    # the fp32 distributed optimizer's main params are views of the model params (leaves)
    with torch.no_grad(), _torch_adamw_state_load(optimizer):
        optimizer.load_state_dict(state["optimizer"])


@contextlib.contextmanager
def _torch_adamw_state_load(optimizer) -> Iterator[None]:
    """Two fixes for megatron-core 0.16.1 loading distributed-optimizer state into torch's AdamW
    (used when neither TransformerEngine nor apex is installed), which keeps a "step" tensor in
    every parameter's state:
      - the `fully_reshardable` loader copies every per-parameter entry from the checkpoint,
        which stores "step" per group instead: hide it during each copy;
      - the step is restored as ONE tensor shared by every parameter, which AdamW then
        increments once per parameter: give each parameter its own copy afterwards."""
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    for opt in optimizers:
        copy_states = opt._set_main_param_and_optimizer_states

        def without_step(model_param, tensors, opt=opt, copy_states=copy_states):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            param_state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
            step = param_state.pop("step", None)
            copy_states(model_param, tensors)
            if step is not None:
                param_state["step"] = step

        opt._set_main_param_and_optimizer_states = without_step
    try:
        yield
    finally:
        for opt in optimizers:
            del opt._set_main_param_and_optimizer_states  # back to the class method
            for param_state in opt.optimizer.state.values():
                if "step" in param_state:
                    param_state["step"] = param_state["step"].clone()
