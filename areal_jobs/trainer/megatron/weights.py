"""Weights in and out of the Megatron model: HF safetensors in, HF-named tensors and directories
out, and Megatron dist checkpoints of model + distributed optimizer.

HF -> Megatron: each rank reads only the HF tensors its own TP/PP shard needs (lazily, by name)
and the adapter in megatron_convert.py lays them out. Megatron -> HF: each exported parameter
is all-gathered over the TP group, merged and converted; the stage's TP rank 0 yields it. An
expert's weight is all-gathered over the expert-TP group, then over the expert-parallel group
(each EP rank holds its own experts in the same local slots), so the sender yields every expert.
Dist checkpoints store the optimizer state in model space (`fully_reshardable`), so a
checkpoint saved at one TP/PP/DP layout loads at another.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
    ep_peer,
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
    experts: ExpertLayout | None = None,
) -> None:
    """Copy this rank's shard of the HF checkpoint into the (unwrapped) GPTModel."""
    experts = experts or ExpertLayout()
    shard = hf_to_megatron_shard(
        SafetensorsReader(model_path).get,
        dims,
        tp_size=tp_size,
        tp_rank=tp_rank,
        pp_size=pp_size,
        pp_rank=pp_rank,
        te_fused_norms=te_fused_norms,
        ep_size=experts.ep_size,
        ep_rank=experts.ep_rank,
        expert_tp_size=experts.etp_size,
        expert_tp_rank=experts.etp_rank,
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
             pp_rank: int, use_te: bool, attention: Attention = Attention.varlen,
             experts: ExpertLayout | None = None) -> torch.nn.Module:  # fmt: skip
    """This stage's GPTModel built from `config` with the HF weights (its TP and EP shards)."""
    gpt = build_gpt(dims, config, use_te=use_te, attention=attention)
    load_hf_weights(
        gpt, model_path, dims, tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank,
        te_fused_norms=use_te, experts=experts,
    )  # fmt: skip
    return gpt


@dataclass(frozen=True)
class ExpertLayout:
    """This rank's place in the expert grid (parallel_state's expert groups)."""

    ep_size: int = 1
    ep_rank: int = 0
    etp_size: int = 1
    etp_rank: int = 0
    edp_rank: int = 0  # expert-data-parallel rank: 0 = the replica whose experts are exported

    @classmethod
    def current(cls) -> ExpertLayout:
        ps = parallel_state
        return cls(
            ep_size=ps.get_expert_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            edp_rank=ps.get_expert_data_parallel_rank(),
        )


def all_experts(maps: list[ParamMap], dims: ModelDims, ep_size: int) -> list[ParamMap]:
    """`maps` with every expert-parallel rank's experts, in the order `gathered_hf_tensors` yields."""
    return [
        peer
        for pm in maps
        for peer in ([pm] if pm.expert is None else [ep_peer(pm, dims, ep_size, r) for r in range(ep_size)])
    ]


def hf_specs(maps: list[ParamMap], dims: ModelDims, dtype: torch.dtype, ep_size: int = 1) -> list[TensorSpec]:
    """HF name, dtype and shape of every tensor `gathered_hf_tensors` yields, in its order."""
    dtype_name = str(dtype).removeprefix("torch.")
    return [
        TensorSpec(name=name, dtype=dtype_name, shape=shape)
        for pm in all_experts(maps, dims, ep_size)
        for name, shape in zip(pm.hf_names, hf_shapes(pm, dims), strict=True)
    ]


def _gather(local: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    if size == 1:
        return [local]
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return shards


def gathered_hf_tensors(
    gpt: torch.nn.Module,
    maps: list[ParamMap],
    dims: ModelDims,
    dtype: torch.dtype,
    tp_size: int,
    tp_rank: int,
    *,
    dense: bool = True,
    experts: ExpertLayout | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors of `maps`; the sender (TP rank 0 of DP rank 0, expert rank 0) gets them.
    Who must iterate: `dense` ranks (the sender's TP group) join the TP gathers of the dense
    weights; with `experts`, the expert-DP-rank-0 ranks (the sender's expert-TP x EP block) join
    the expert gathers. One rank may be both; the gathers run in the order of `maps` everywhere."""
    experts = experts or ExpertLayout()
    params = dict(gpt.named_parameters())
    tp_group = parallel_state.get_tensor_model_parallel_group()
    sender = tp_rank == 0 and experts.ep_rank == 0 and experts.etp_rank == 0
    for pm in maps:
        local = params[pm.megatron_name].detach()
        if pm.expert is None:
            if not dense:
                continue
            fulls = [(pm, merge_tp(pm, _gather(local, tp_size, tp_group)))]
        else:
            if experts.edp_rank != 0:
                continue
            etp_group = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
            full = merge_tp(pm, _gather(local, experts.etp_size, etp_group))
            ep_group = parallel_state.get_expert_model_parallel_group(check_initialized=False)
            peers = _gather(full, experts.ep_size, ep_group)
            fulls = [(ep_peer(pm, dims, experts.ep_size, r), t) for r, t in enumerate(peers)]
        if sender and dense:
            for peer, full in fulls:
                for name, tensor in zip(peer.hf_names, full_to_hf(peer, full, dims), strict=True):
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
        for name in pm.hf_names  # ep_size 1: every expert
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
