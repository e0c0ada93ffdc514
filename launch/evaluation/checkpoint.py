"""Which Hugging Face directory `launch.evaluate` serves for a checkpoint argument.

    RUN_DIR/final_hf/ or any HF dir   served as is (config.json + safetensors + tokenizer)
    a PEFT adapter directory          (model.lora.final_hf=adapter: adapter_config.json naming the
                                      base + adapter_model.safetensors) merged into its base once,
                                      written beside the adapters (DIR/merged/)
    RUN_DIR/checkpoints/step_N/       a mid-run checkpoint of the torch trainer: its model
                                      state (trainer/trainer.pt; with LoRA the adapters only) is
                                      written once as an HF dir beside it (step_N/hf/), from the
                                      run's base model and model.lora
    RUN_DIR/checkpoints/latest        the step it names

Megatron's mid-run checkpoints are sharded per rank and are not converted here: evaluate the
run's final_hf/ (written by every backend) instead.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from areal_jobs.config import load_job_config
from areal_jobs.trainer.forward import lora

logger = logging.getLogger("launch.evaluate")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "generation_config.json")  # fmt: skip


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def resolve_hf_dir(ckpt: str) -> Path:
    """An HF directory with weights and tokenizer for `ckpt` (converting a mid-run checkpoint)."""
    path = Path(ckpt).resolve()
    if path.name == "latest" and path.is_file():
        path = path.parent / path.read_text().strip()
    if is_hf_dir(path):
        return path
    if lora.is_adapter_dir(path):
        return _merge_adapter_dir(path)
    trainer_state = path / "trainer" / "trainer.pt"
    if trainer_state.exists():
        return _convert_torch_checkpoint(path, trainer_state)
    if (path / "trainer").is_dir():
        raise ValueError(
            f"{path} is a Megatron mid-run checkpoint (sharded per rank): evaluate the run's final_hf/ "
            "or a torch-trainer checkpoint"
        )
    raise ValueError(f"{path} is neither an HF directory (config.json + *.safetensors) nor a checkpoint step")


def _convert_torch_checkpoint(step_dir: Path, trainer_state: Path) -> Path:
    out = step_dir / "hf"
    if is_hf_dir(out):
        return out
    import torch
    from transformers import AutoModelForCausalLM

    run_dir = step_dir.parent.parent
    cfg = load_job_config(run_dir / "config.yaml")
    base = Path(cfg.model.path or cfg.model.builtin_dir)
    if not base.is_absolute() and not base.exists():
        base = Path(__file__).resolve().parents[2] / base  # the built-in model, relative to the checkout
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    state = torch.load(trainer_state, map_location="cpu", weights_only=False)["model"]
    if any(lora.is_adapter_key(k) for k in state):  # a LoRA run: the adapters on the frozen base
        lora.apply_lora(model, cfg.model.lora)
    _load_exactly(model, state, trainer_state)
    _save_plain(model, out, base)
    logger.info("mid-run checkpoint %s written as an HF directory at %s", step_dir, out)
    return out


def _merge_adapter_dir(folder: Path) -> Path:
    """A PEFT adapter directory merged into its base model (adapter_config.json names it)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = folder / "merged"
    if is_hf_dir(out):
        return out
    cfg, base, adapters = lora.read_adapter_dir(folder)
    if not base or not is_hf_dir(Path(base)):
        raise ValueError(f"{folder}: its base model {base!r} (adapter_config.json) is not an HF directory")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora.apply_lora(model, cfg)
    _load_exactly(model, adapters, folder)
    _save_plain(model, out, Path(base), tokenizer_from=folder)
    logger.info("adapters %s merged into %s at %s", folder, base, out)
    return out


def _load_exactly(model, state: dict, source: Path) -> None:
    """Every tensor of `state` must land (a LoRA state leaves only the frozen base unloaded)."""
    loaded = model.load_state_dict(state, strict=False)
    missing = [k for k in loaded.missing_keys if lora.is_adapter_key(k) or not lora.lora_layers(model)]
    if loaded.unexpected_keys or missing:
        raise ValueError(
            f"{source} does not fit its model (missing {missing[:3]}, unexpected {loaded.unexpected_keys[:3]})"
        )


def _save_plain(model, out: Path, base: Path, tokenizer_from: Path | None = None) -> None:
    """The model with its adapters (if any) merged, as a plain HF directory, written whole or not at all."""
    lora.merge_(model)
    state = {k: v for k, v in model.state_dict().items() if not lora.is_adapter_key(k)}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # an HF checkpoint of a tied model stores only the embedding
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
    for name in TOKENIZER_FILES:
        for source in (tokenizer_from, base):
            if source is not None and (source / name).exists():
                shutil.copyfile(source / name, tmp / name)
                break
    tmp.replace(out)  # complete or absent: a crash mid-write leaves no half directory behind
