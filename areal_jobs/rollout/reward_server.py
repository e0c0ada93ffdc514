"""Start one reward-model server (reward.model.*) and register its address.

    python -m areal_jobs.rollout.reward_server --config RUN_DIR/config.yaml --index I

The same launch as a rollout server (server.py: the engine, the API key from the environment, the
CPU compatibility path, the start-up wait that follows progress), with the reward model's own
slice: its checkpoint, engine, TP size, pool size and threads. A discriminative model is served
as a pooling model (SGLang `--is-embedding`: /classify answers the head's logits). Once healthy it
writes RUN_DIR/reward_servers/I.json; the controller's reward scorer discovers servers there, and
finds a restarted one (launch.local restarts a server that dies) under the same index.

SGLang 0.5.23 builds the head of Qwen2/Qwen3ForSequenceClassification as a Linear *with* a bias,
where Hugging Face's has none: a checkpoint without `score.bias` leaves SGLang's at its random
initialisation, which shifts every score by a constant (measured: -0.036 on a test head).
`check_checkpoint` refuses such a checkpoint before any process starts; the built-in reward
model carries a zero bias (tasks/warm_start/reward_model.py), and `python -m areal_jobs.rollout.reward_server
--add-zero-bias DIR` writes one into a copy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import struct
import sys
from pathlib import Path

from areal_jobs.config import (
    JobConfig,
    LoraConfig,
    ModelConfig,
    RewardModelConfig,
    RewardModelKind,
    RolloutConfig,
    load_job_config,
)
from areal_jobs.logs import setup_logging
from areal_jobs.rollout.server import serve
from areal_jobs.transport import discovery

logger = logging.getLogger("areal_jobs.rollout.reward_server")

# SGLang's heads with a bias Hugging Face's lack (sglang/srt/models/qwen{2,3}_classification.py)
BIASED_HEADS = {"Qwen2ForSequenceClassification": "score", "Qwen3ForSequenceClassification": "score"}


def checkpoint_tensors(model_dir: Path) -> set[str]:
    """Tensor names in a Hugging Face directory's safetensors files (headers only)."""
    names: set[str] = set()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            names |= {k for k in json.loads(f.read(size)) if k != "__metadata__"}
    return names


def check_checkpoint(cfg: RewardModelConfig) -> None:
    """ValueError naming the fix when reward.model.path cannot be served as configured."""
    config_path = Path(cfg.path) / "config.json"
    if not config_path.exists():
        raise ValueError(
            f"reward.model.path={cfg.path} has no config.json: point it at a Hugging Face model directory"
        )
    archs = json.loads(config_path.read_text()).get("architectures") or []
    classifier = any(a.endswith(("ForSequenceClassification", "ForRewardModel")) for a in archs)
    if cfg.kind is RewardModelKind.discriminative and not classifier:
        raise ValueError(
            f"reward.model.path={cfg.path} is {archs}, not a *ForSequenceClassification model: "
            "reward.model.kind=generative serves it as a judge"
        )
    if cfg.kind is RewardModelKind.generative and classifier:
        raise ValueError(
            f"reward.model.path={cfg.path} is a classifier ({archs}): set reward.model.kind=discriminative"
        )
    for arch in archs:
        head = BIASED_HEADS.get(arch)
        if head and f"{head}.bias" not in checkpoint_tensors(Path(cfg.path)):
            raise ValueError(
                f"reward.model.path={cfg.path}: SGLang serves {arch} with a {head}.bias the checkpoint lacks "
                "(it would keep a random value and shift every score); write a copy with a zero bias: "
                f"python -m areal_jobs.rollout.reward_server --add-zero-bias {cfg.path} --out <dir>"
            )


def add_zero_bias(model_dir: Path, out_dir: Path) -> Path:
    """A copy of `model_dir` whose classification head has a zero bias (what Hugging Face computes)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    archs = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    head = next((BIASED_HEADS[a] for a in archs if a in BIASED_HEADS), None)
    if head is None:
        raise ValueError(f"{model_dir} is {archs}: no head SGLang serves with an extra bias")
    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    for path in sorted(out_dir.glob("*.safetensors")):
        tensors = load_file(str(path))
        weight = tensors.get(f"{head}.weight")
        if weight is not None:
            tensors[f"{head}.bias"] = torch.zeros(weight.shape[0], dtype=weight.dtype)
            save_file(tensors, str(path), metadata={"format": "pt"})
            return out_dir
    raise ValueError(f"no {head}.weight in {model_dir}'s safetensors files")


def server_slices(cfg: JobConfig) -> tuple[RolloutConfig, ModelConfig]:
    """The rollout and model slices server.start_server takes, made from reward.model."""
    rm = cfg.reward.model
    extra = list(rm.extra_server_args)
    if rm.kind is RewardModelKind.discriminative and "--is-embedding" not in extra:
        extra.append("--is-embedding")
    rollout = dataclasses.replace(
        cfg.rollout, engine=rm.engine, tp_size=rm.tp_size, max_total_tokens=rm.max_total_tokens,
        server_threads=rm.server_threads, gpu_memory_fraction=rm.gpu_memory_fraction,
        release_memory_while_training=False, extra_server_args=extra, base_port=rm.base_port,
    )  # fmt: skip
    return rollout, dataclasses.replace(cfg.model, path=rm.path, lora=LoraConfig())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", help="resolved run config (RUN_DIR/config.yaml)")
    parser.add_argument("--index", type=int, default=0, help="server index in 0..reward.model.num_servers-1")
    parser.add_argument(
        "--add-zero-bias", type=Path, help="write a copy of this classifier with a zero head bias"
    )
    parser.add_argument("--out", type=Path, help="--add-zero-bias: the copy's directory")
    args = parser.parse_args(argv)
    if args.add_zero_bias:
        if args.out is None:
            parser.error("--add-zero-bias needs --out")
        print(add_zero_bias(args.add_zero_bias, args.out))
        return 0
    if not args.config:
        parser.error("--config is required")
    setup_logging(f"reward-server{args.index}")
    cfg = load_job_config(args.config)
    run_dir = Path(args.config).resolve().parent
    rollout, model = server_slices(cfg)
    return serve(
        cfg, run_dir, args.index, str(Path(model.path).resolve()), rollout, model,
        f"reward-{rollout.engine.value}-{args.index}.log", seed=cfg.trainer.seed,
        folder=discovery.REWARD_SERVERS,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
