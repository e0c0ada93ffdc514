"""LoRA on a Hugging Face causal LM, without peft: adapters beside the target linear layers.

`apply_lora` freezes the whole model and gives every target `nn.Linear` (its name ends in one of
model.lora.target_modules) two trainable children, `lora_A` [r, in] (Kaiming-uniform, as PEFT) and
`lora_B` [out, r] (zeros: the model starts exactly as the base), in the model's dtype, and a
forward hook that adds `lora_B(lora_A(dropout(x))) * alpha / r` to the layer's output. The layer
itself is untouched, so every base parameter keeps its Hugging Face name (`...q_proj.weight`) and
the adapters are named `...q_proj.lora_A.weight`, which is PEFT's name minus its
`base_model.model.` prefix. FSDP2 shards the adapters with their decoder layer.

What leaves the trainer is built from a name -> tensor state (full tensors, wherever they were
gathered), so the torch and FSDP backends share it:
  `merged_state`  base + B·A·scale under the HF names, adapters dropped: a plain HF checkpoint
  `adapter_state` the adapters alone; `write_adapter_dir` stores them as a PEFT directory
                  (adapter_config.json + adapter_model.safetensors, PEFT key names) that SGLang,
                  vLLM and peft load; `read_adapter_dir` reads one back.
`merge_` / `unmerge_` fold the adapters into the layers in place (and back) for inference.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from areal_jobs.config.lora import LoraConfig

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_A, _B = ".lora_A.weight", ".lora_B.weight"


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int = 0) -> list[str]:
    """Freeze `model` and attach adapters to its target linear layers; returns their names. A is
    drawn from its own generator (`seed`): every rank and every backend starts from the same A."""
    targets = tuple(cfg.target_modules)
    if "lm_head" in targets:  # tied to the embedding in most small models; engines differ on it
        raise ValueError("model.lora.target_modules: lm_head is not supported (adapt the projections)")
    model.requires_grad_(False)
    wrapped, linear_suffixes = [], set()
    generator = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        suffix = name.rsplit(".", 1)[-1]
        linear_suffixes.add(suffix)
        if suffix in targets:
            _attach(module, cfg, generator)
            wrapped.append(name)
    if not wrapped:
        raise ValueError(
            f"model.lora.target_modules={list(targets)} matches no linear layer of {type(model).__name__}; "
            f"its linear layers are named {sorted(linear_suffixes)}"
        )
    return wrapped


def _attach(layer: nn.Linear, cfg: LoraConfig, generator: torch.Generator) -> None:
    kind = {"dtype": layer.weight.dtype, "device": layer.weight.device}
    layer.lora_A = nn.Linear(layer.in_features, cfg.rank, bias=False, **kind)
    layer.lora_B = nn.Linear(cfg.rank, layer.out_features, bias=False, **kind)
    with torch.no_grad():  # PEFT's init: A Kaiming-uniform, B zero
        a = torch.empty(layer.lora_A.weight.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        layer.lora_A.weight.copy_(a)
        layer.lora_B.weight.zero_()
    layer.lora_dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
    layer.lora_scaling = cfg.scaling
    layer.lora_merged = False
    layer.register_forward_hook(_add_adapter_output)


def _add_adapter_output(layer: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    if layer.lora_merged:
        return output
    return output + layer.lora_B(layer.lora_A(layer.lora_dropout(args[0]))) * layer.lora_scaling


def lora_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "lora_A")]


@torch.no_grad()
def merge_(model: nn.Module) -> None:
    """Fold every adapter into its layer's weight (the hook then adds nothing)."""
    for layer in lora_layers(model):
        if not layer.lora_merged:
            layer.weight += _delta(layer.weight, layer.lora_A.weight, layer.lora_B.weight, layer.lora_scaling)
            layer.lora_merged = True


@torch.no_grad()
def unmerge_(model: nn.Module) -> None:
    """Undo `merge_` (up to rounding in the model's dtype)."""
    for layer in lora_layers(model):
        if layer.lora_merged:
            layer.weight -= _delta(layer.weight, layer.lora_A.weight, layer.lora_B.weight, layer.lora_scaling)
            layer.lora_merged = False


def _delta(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """B·A·scale in float32, cast to the weight's dtype."""
    return ((b.float() @ a.float()) * scaling).to(weight.dtype)


def is_adapter_key(name: str) -> bool:
    return name.endswith((_A, _B))


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if is_adapter_key(k)}


def merged_state(state: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """HF names only, each adapted weight replaced by weight + B·A·scale (a new tensor: the
    model's own weights never drift through repeated merges)."""
    out = {k: v for k, v in state.items() if not is_adapter_key(k)}
    for key in state:
        if key.endswith(_A):
            layer = key[: -len(_A)]
            weight = state[layer + ".weight"]
            out[layer + ".weight"] = weight + _delta(weight, state[key], state[layer + _B], scaling)
    return out


def adapter_config(cfg: LoraConfig, base_model: str) -> dict:
    """PEFT's adapter_config.json for these adapters (what SGLang, vLLM and peft read)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def write_adapter_dir(folder: str | Path, adapters: Mapping[str, torch.Tensor], cfg: LoraConfig,
                      base_model: str) -> int:  # fmt: skip
    """A PEFT adapter directory, written whole or not at all; returns the weights file's bytes."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in adapters.items()}
    if not tensors or not all(is_adapter_key(k) for k in adapters):
        raise ValueError(f"not an adapter state: {sorted(adapters)[:4]}")
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg, base_model), indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return (folder / ADAPTER_WEIGHTS).stat().st_size


def is_adapter_dir(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).exists() and (Path(folder) / ADAPTER_WEIGHTS).exists()


def read_adapter_dir(folder: str | Path) -> tuple[LoraConfig, str, dict[str, torch.Tensor]]:
    """(its LoraConfig, its base model path, its adapters under the model's own names)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    raw = json.loads((folder / ADAPTER_CONFIG).read_text())
    if raw.get("peft_type", "LORA") != "LORA" or raw.get("use_dora") or raw.get("use_rslora"):
        raise ValueError(f"{folder}: only plain LoRA adapters are supported (peft_type LORA, no DoRA/rsLoRA)")
    cfg = LoraConfig(
        rank=int(raw["r"]),
        alpha=float(raw["lora_alpha"]),
        dropout=float(raw.get("lora_dropout", 0.0)),
        target_modules=list(raw["target_modules"]),
    )
    tensors = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(folder / ADAPTER_WEIGHTS)).items()}
    return cfg, raw.get("base_model_name_or_path", ""), tensors


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "chat_template.jinja", "generation_config.json")  # fmt: skip


def copy_tokenizer(base: Path, folder: Path) -> None:
    """The base model's tokenizer files into an adapter directory (PEFT directories carry one)."""
    for name in TOKENIZER_FILES:
        if (base / name).exists():
            shutil.copyfile(base / name, folder / name)  # the run's umask


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What the optimiser updates: every parameter, or only the adapters once `apply_lora` froze
    the rest."""
    return [p for p in model.parameters() if p.requires_grad]
