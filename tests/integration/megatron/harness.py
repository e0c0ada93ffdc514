"""Shared pieces of the Megatron tests: tiny HF models, synthetic batches, spawned gloo ranks.

Workers run in fresh `spawn` processes (one per rank, one torch thread each) with the env://
variables torchrun would set; they return numpy arrays and floats, never tensors. `run_ranks`
fails on the first rank error and kills every rank at a hard deadline, so a hung collective
fails the test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

FAMILIES = ("llama", "qwen2", "qwen3")
VOCAB = 200  # not a multiple of 128: the padded vocab columns are exercised (and split at TP=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world: int, port: int, results: Any, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    try:
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        from areal_jobs.trainer.megatron.dist import shutdown_distributed

        shutdown_distributed()


def run_ranks(fn: Callable, world: int, *args: Any, timeout_s: float = 240.0) -> list[Any]:
    """Run `fn(rank, world, *args)` in `world` spawned processes; their results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    # not daemonic: dist_checkpointing.save starts a helper process of its own
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, results, args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}
    try:
        while len(out) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{fn.__name__}: ranks {sorted(set(range(world)) - set(out))} gave no result in {timeout_s}s"
                )
            try:
                rank, status, value = results.get(timeout=min(remaining, 5.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RuntimeError(f"{fn.__name__}: rank(s) {dead} died without a result") from None
                continue
            if status == "error":
                raise RuntimeError(f"{fn.__name__} failed on rank {rank}:\n{value}")
            out[rank] = value
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return [out[r] for r in range(world)]


def make_tiny_hf(path: Path, family: str, *, tied: bool = False, seed: int = 0, num_layers: int = 2) -> Path:
    """A tiny random fp32 HF model (every parameter random, biases and norms included).
    qwen3_moe: 4 experts, top-2, renormalised, attention biases (o_proj's too), as the built-in
    MoE policy (areal_jobs/tasks/models/builtin_model_moe) has them."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    }
    config_cls, model_cls = classes[family]
    moe = (
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
             attention_bias=True, router_aux_loss_coef=0.01)
        if family == "qwen3_moe"
        else {}
    )  # fmt: skip
    config = config_cls(
        **moe,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return path


def make_batch(seed: int = 0, *, num_groups: int = 4, group_size: int = 2, vocab: int = VOCAB):
    """A TrainBatch with varied prompt/output lengths, behaviour log-probs and advantages."""
    from areal_jobs.trainer.intake.batch import TrainBatch, TrainSample

    rng = np.random.default_rng(seed)
    samples = []
    for g in range(num_groups):
        prompt = rng.integers(1, vocab, size=int(rng.integers(3, 9)))
        for i in range(group_size):
            n = int(rng.integers(2, 12))
            output = rng.integers(1, vocab, size=n)
            samples.append(
                TrainSample(
                    sample_id=f"g{g}s{i}",
                    input_ids=np.concatenate([prompt, output]).astype(np.int64),
                    num_prompt_tokens=len(prompt),
                    behav_logprobs=(np.log(1.0 / vocab) + 0.3 * rng.standard_normal(n)).astype(np.float32),
                    versions=np.zeros(n, dtype=np.int32),
                    advantage=float(rng.choice([-1.0, -0.5, 0.5, 1.0])),
                    reward=0.0,
                )
            )
    return TrainBatch(version=0, samples=samples, group_ids=[f"g{g}" for g in range(num_groups)])


def trainer_config(tp: int = 1, pp: int = 1, dp: int = 1, **overrides: Any):
    from areal_jobs.config import TrainerBackend, TrainerConfig

    fields = {
        "lr": 1e-3,
        "grad_clip": 1.0,
        "max_tokens_per_microbatch": 40,
        "weight_decay": 0.01,
        "seed": 1,
    }
    fields.update(overrides)
    return TrainerConfig(backend=TrainerBackend.megatron, tp_size=tp, pp_size=pp, dp_size=dp, **fields)


def start_backend(model_dir: Path | str, trainer, algo=None, dtype=None):
    """init_distributed + MegatronBackend(...).setup(), as trainer/main.py does."""
    from areal_jobs.config import AlgoConfig, DType
    from areal_jobs.trainer.megatron.backend import MegatronBackend
    from areal_jobs.trainer.megatron.dist import init_distributed

    init_distributed(trainer, timeout_s=120.0)
    # decoupled: what these parity steps were written against (the default before issue 42);
    # naive PPO, the default now, is the backend contract's decoupled_false case
    backend = MegatronBackend(
        trainer, algo or AlgoConfig(decoupled=True), str(model_dir), dtype or DType.float32
    )
    backend.setup()
    return backend


def exported(backend) -> dict[str, np.ndarray]:
    """Every rank joins the export; senders return their HF-named tensors."""
    return {name: t.float().cpu().numpy().copy() for name, t in backend.iter_weights()}


def hf_logits(model_dir: Path | str, batch) -> np.ndarray:
    """transformers' fp32 logits for every sample of `batch`, concatenated: [T, V]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.cat([model(torch.as_tensor(s.input_ids)[None]).logits[0] for s in batch.samples]).numpy()


def hf_state(model_dir: Path | str) -> dict[str, np.ndarray]:
    """Exactly the tensors of the HF checkpoint on disk."""
    from safetensors.numpy import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def torch_backend_step(
    model_dir: Path | str, batch, trainer, algo=None, lora=None
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """The torch backend's step on the same batch and weights: (metrics, exported HF state)."""
    from dataclasses import replace

    from areal_jobs.config import AlgoConfig, DType, TrainerBackend
    from areal_jobs.trainer.torch.backend import TorchBackend

    cfg = replace(trainer, backend=TrainerBackend.torch, tp_size=1, pp_size=1, dp_size=1)
    # decoupled: what these parity steps were written against (the default before issue 42);
    # naive PPO, the default now, is the backend contract's decoupled_false case
    backend = TorchBackend(cfg, algo or AlgoConfig(decoupled=True), str(model_dir), DType.float32, lora)
    backend.setup()
    metrics = backend.train_step(batch)
    return metrics, {k: v.detach().numpy().copy() for k, v in backend.iter_weights()}


def max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)).max()) for k in a)


def update_diff(after: dict[str, np.ndarray], expected: dict[str, np.ndarray], before: dict[str, np.ndarray]):
    """(max |after - expected|, ||after - expected|| / ||expected - before||) over all tensors.

    The first AdamW step moves each weight by about lr * g / (|g| + eps), so weights whose
    gradient is near zero (tied-embedding rows of tokens absent from the batch) turn float
    rounding of g into visible differences: the relative norm is the meaningful measure."""
    assert set(after) == set(expected) == set(before), sorted(set(after) ^ set(expected))
    diff = sum(float(np.sum((after[k].astype(np.float64) - expected[k]) ** 2)) for k in after)
    step = sum(float(np.sum((expected[k].astype(np.float64) - before[k]) ** 2)) for k in after)
    return max_abs_diff(after, expected), (diff / step) ** 0.5
