"""Which Hugging Face directory `launch.evaluate` serves for a checkpoint argument.

    RUN_DIR/final_hf/ or any HF dir   served as is (config.json + safetensors + tokenizer)
    RUN_DIR/checkpoints/step_N/       a mid-run checkpoint of the torch trainer: its model
                                      state (trainer/trainer.pt) is written once as an HF dir
                                      beside it (step_N/hf/), from the run's base model config
    RUN_DIR/checkpoints/latest        the step it names

Megatron's mid-run checkpoints are sharded per rank and are not converted here: evaluate the
run's final_hf/ (written by every backend) instead.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from areal_jobs.config import load_job_config

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
    model.load_state_dict(state)
    tmp = out.with_name("hf.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (base / name).exists():
            shutil.copy(base / name, tmp / name)
    tmp.replace(out)  # complete or absent: a crash mid-write leaves no half directory behind
    logger.info("mid-run checkpoint %s written as an HF directory at %s", step_dir, out)
    return out
