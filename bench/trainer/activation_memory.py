"""Activation memory of one training step per `trainer.recompute` (and `trainer.attention`), on CPU.

    python -m bench.trainer.activation_memory            # ~6 min on 2 cores, one fresh process per point
    python -m bench.trainer.activation_memory --quick    # 1,024 tokens only

Each point is one spawned process: large allocations made mmaps of their own (mallopt), so the
RSS follows the live tensors; set a backend up (torch or Megatron TP=1, fp32, one thread),
then reset the kernel's peak-RSS mark (/proc/self/clear_refs, 5) and run one `train_step` on one
packed micro-batch of T tokens (4 sequences of T/4, prompt T/16 each). Reported: the peak RSS
above the RSS just before the step (MiB), which holds the step's activations, the logits and
log-prob temporaries, the gradients and the AdamW state (3 x parameter bytes, printed alongside).
Two depths (2 and 4 layers) and two lengths separate what each decoder layer keeps per token
from the rest (embedding, logits, loss) and from what does not grow with tokens (gradients,
AdamW state): per layer = the double difference over depth and length.

The model is Qwen2-shaped and small, with a small vocabulary so the logits do not hide the
layers (the log-prob chunking is another piece of work): hidden 256, FFN 768, 8 heads, 2 KV
groups (head 32), vocab 1,024, fp32. The numbers feed the trainer's memory model.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HIDDEN, FFN, HEADS, GROUPS, VOCAB = 256, 768, 8, 2, 1024
TIMEOUT_S = 600.0


def build_model(out_dir: Path, num_layers: int) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=num_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=GROUPS,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(str(out_dir))
    return out_dir


def make_batch(num_tokens: int):
    from areal_jobs.trainer.intake.batch import TrainBatch, TrainSample

    rng = np.random.default_rng(0)
    length, prompt = num_tokens // 4, num_tokens // 16
    samples = [
        TrainSample(
            f"s{i}",
            rng.integers(1, VOCAB, length).astype(np.int64),
            prompt,
            np.full(length - prompt, -7.0, np.float32),
            np.zeros(length - prompt, np.int32),
            float(rng.choice([-1.0, 1.0])),
            0.0,
        )
        for i in range(4)
    ]
    return TrainBatch(version=0, samples=samples, group_ids=["g"])


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _point(backend: str, model_dir: str, num_tokens: int, recompute: str, attention: str, conn) -> None:
    """Child process: one backend, one step; sends (MiB above the pre-step RSS, parameter MiB,
    step seconds: the first step, so one-off costs are in it; a rough figure on a shared machine)."""
    import ctypes
    import gc

    # every allocation over 64 KiB is its own mmap, returned to the kernel when freed: glibc's
    # default (a threshold that grows to 32 MiB, freed memory kept in the heap) leaves the pages of
    # tensors already freed in the RSS, so the peak would count allocator reuse patterns
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD (also turns off its dynamic growth)
    libc.mallopt(-1, 64 * 1024)  # M_TRIM_THRESHOLD
    import torch

    from areal_jobs.config import AlgoConfig, Attention, DType, Recompute, TrainerBackend, TrainerConfig

    torch.set_num_threads(1)
    cfg = TrainerConfig(
        backend=TrainerBackend(backend),
        lr=1e-5,
        max_tokens_per_microbatch=num_tokens,
        recompute=Recompute(recompute),
        attention=Attention(attention),
    )
    if backend == "megatron":
        from areal_jobs.trainer.megatron.backend import MegatronBackend as Backend
    else:
        from areal_jobs.trainer.torch.backend import TorchBackend as Backend
    trainer = Backend(cfg, AlgoConfig(), model_dir, DType.float32)
    trainer.setup()
    batch = make_batch(num_tokens)
    params = sum(t.numel() * t.element_size() for _, t in trainer.iter_weights())
    gc.collect()
    before_kib = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS (VmHWM) := current RSS
    start = time.perf_counter()
    trainer.train_step(batch)
    step_s = time.perf_counter() - start
    conn.send(((_status_kib("VmHWM") - before_kib) / 1024, params / 2**20, step_s))


def measure(backend: str, model_dir: str, num_tokens: int, recompute: str, attention: str = "varlen"):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_point, args=(backend, model_dir, num_tokens, recompute, attention, child))
    proc.start()
    try:
        if not parent.poll(TIMEOUT_S):
            raise RuntimeError(f"{backend} {recompute} T={num_tokens}: no answer (exit {proc.exitcode})")
        return parent.recv()
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)


POINTS = {  # backend -> (recompute, attention) modes measured
    "torch": [("none", "varlen"), ("full", "varlen"), ("none", "dense")],
    "megatron": [("none", "varlen"), ("selective", "varlen"), ("full", "varlen"), ("none", "dense")],
}


def run(quick: bool = False) -> dict[str, float]:
    """Peak MiB per point; with both lengths, per mode: KB per token per decoder layer (the
    double difference over depth and length, so constants such as the gradients and the AdamW
    state, which grow with depth but not with tokens, drop out) and KB per token of the rest
    (embedding, logits, loss; under full recompute also the one layer being recomputed)."""
    lengths = [1024] if quick else [1024, 4096]
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="activation_memory_") as tmp:
        models = {n: str(build_model(Path(tmp) / f"l{n}", n)) for n in (2, 4)}
        for backend, modes in POINTS.items():
            for recompute, attention in modes:
                mode = f"activation_memory/{backend}/{recompute}/{attention}"
                for num_tokens in lengths:
                    for layers, model in models.items():
                        mib, params_mib, step_s = measure(backend, model, num_tokens, recompute, attention)
                        out[f"{mode}/T{num_tokens}/L{layers}_peak_mib"] = mib
                        out[f"{mode}/T{num_tokens}/L{layers}_step_s"] = step_s
                        out[f"activation_memory/params_L{layers}_mib"] = params_mib
                        print(f"{mode}/T{num_tokens}/L{layers}: {mib:8.1f} MiB above the pre-step RSS, "
                              f"step {step_s:.2f} s", flush=True)  # fmt: skip
                if len(lengths) == 2:
                    t1, t2 = lengths
                    peak = {(t, n): out[f"{mode}/T{t}/L{n}_peak_mib"] for t in lengths for n in models}
                    kib_per_token = 1024 / (t2 - t1)  # MiB per token -> KiB per token
                    per_layer = (peak[t2, 4] - peak[t2, 2] - peak[t1, 4] + peak[t1, 2]) / 2 * kib_per_token
                    out[f"{mode}/per_layer_kib_per_token"] = per_layer
                    out[f"{mode}/rest_kib_per_token"] = (
                        peak[t2, 2] - peak[t1, 2]
                    ) * kib_per_token - 2 * per_layer
                    print(f"{mode}: {per_layer:.2f} KiB per token per layer, rest "
                          f"{out[f'{mode}/rest_kib_per_token']:.2f} KiB per token", flush=True)  # fmt: skip
    return out


if __name__ == "__main__":
    results = run(quick="--quick" in sys.argv[1:])
    print(json.dumps(results, indent=1))
