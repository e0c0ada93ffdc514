"""trainer.attention on Megatron's local spec (megatron/attention.py), one spawned rank at TP=1.

Tiny random Llama, Qwen2 (tied) and Qwen3 (qk-norm), GQA (4 heads, 2 groups). One packed
micro-batch of very different lengths (a 1-token prompt, a 1-token answer, 200 tokens beside
2): the output tokens' fp32 log-probs of varlen (THD PackedSeqParams, per-sequence attention)
against dense (the block-diagonal [T, T] mask) and against transformers run on each sequence
alone; and a train step with varlen allocates no [T, T] tensor, forward or backward (under a
dispatch mode SDPA runs its math decomposition, which shows any score or mask matrix).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from harness import FAMILIES, hf_logits, make_tiny_hf, run_ranks, start_backend, trainer_config

pytestmark = pytest.mark.megatron

LENGTHS = [(1, 6), (5, 1), (40, 160), (2, 3), (9, 30)]  # (prompt, answer) tokens
# fp32 log-probs of order 5-6 (float32 spacing 4.8e-7). varlen rotates each token by its position
# in its sequence and runs the flash kernel per sequence, as transformers does on the sequence
# alone: measured identical (0.0). dense rotates each token by its position in the row (the same
# relative angles, other rounding): 1.4e-6 from transformers, so 1.4e-6 from varlen too.
VS_TRANSFORMERS_TOL = 1e-6
VS_DENSE_TOL = 2e-6


def batch():
    from areal_jobs.trainer.intake.batch import TrainBatch, TrainSample

    rng = np.random.default_rng(11)
    samples = [
        TrainSample(
            f"s{i}",
            rng.integers(1, 200, p + n).astype(np.int64),
            p,
            np.full(n, -5.0, np.float32),
            np.zeros(n, np.int32),
            float(rng.choice([-1.0, 1.0])),
            0.0,
        )
        for i, (p, n) in enumerate(LENGTHS)
    ]
    return TrainBatch(version=0, samples=samples, group_ids=["g"])


def output_logprobs(logits: np.ndarray, samples) -> np.ndarray:
    """log-probs of every output token from logits [T, V] of the packed (or concatenated) row."""
    import torch

    logp = torch.log_softmax(torch.as_tensor(logits, dtype=torch.float32), -1).numpy()
    out, start = [], 0
    for s in samples:
        first, last = start + s.num_prompt_tokens - 1, start + len(s.input_ids) - 1
        out.append(logp[np.arange(first, last), s.input_ids[s.num_prompt_tokens :]])
        start += len(s.input_ids)
    return np.concatenate(out)


def attention_worker(rank: int, world: int, models: dict[str, str]) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from areal_jobs.config import Attention

    class SquareTensors(TorchDispatchMode):
        def __init__(self, size: int):
            super().__init__()
            self.size, self.found = size, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and list(t.shape).count(self.size) >= 2:
                    self.found.append((str(func), tuple(t.shape)))
            return out

    data = batch()
    num_tokens = sum(len(s.input_ids) for s in data.samples)
    out = {}
    for family, path in models.items():
        logp = {}
        for attention in (Attention.varlen, Attention.dense):  # the CPU kinds (flex, varlen_attn: CUDA)
            cfg = trainer_config(attention=attention, max_tokens_per_microbatch=1024)  # one micro-batch
            backend = start_backend(path, cfg)
            logits = backend.full_logits([s.input_ids for s in data.samples]).numpy()
            logp[attention.value] = output_logprobs(logits, data.samples)
            if attention is Attention.varlen:
                with SquareTensors(num_tokens) as seen:
                    backend.train_step(data)
                logp["square_tensors"] = seen.found
        out[family] = logp
    refusals = {}
    for attention in (Attention.flex, Attention.varlen_attn):
        try:
            start_backend(models["qwen2"], trainer_config(attention=attention))
        except ValueError as exc:
            refusals[attention.value] = str(exc)
    out["refusals"] = refusals
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("attention_models")
    models = {f: str(make_tiny_hf(root / f, f, tied=f == "qwen2", seed=i)) for i, f in enumerate(FAMILIES)}
    (out,) = run_ranks(attention_worker, 1, models, timeout_s=300)
    return models, out


@pytest.mark.parametrize("family", FAMILIES)
def test_varlen_logprobs_equal_dense_and_transformers(results, family):
    models, out = results
    data = batch()
    alone = output_logprobs(hf_logits(models[family], data), data.samples)  # one sequence per forward
    varlen, dense = out[family]["varlen"], out[family]["dense"]
    diff = np.abs(varlen - dense)
    print(
        f"{family}: |varlen - dense| max {diff.max():.1e} mean {diff.mean():.1e}; "
        f"|varlen - transformers alone| max {np.abs(varlen - alone).max():.1e}, "
        f"|dense - transformers alone| max {np.abs(dense - alone).max():.1e}"
    )
    assert varlen.shape == (sum(n for _, n in LENGTHS),)
    assert np.abs(varlen - alone).max() < VS_TRANSFORMERS_TOL
    assert diff.max() < VS_DENSE_TOL


def test_varlen_train_step_allocates_no_t_by_t_tensor(results):
    _, out = results
    for family in FAMILIES:
        assert out[family]["square_tensors"] == [], family


def test_cuda_attention_kinds_are_refused_on_cpu(results):
    _, out = results
    assert sorted(out["refusals"]) == ["flex", "varlen_attn"]
    assert all("set trainer.attention=varlen" in message for message in out["refusals"].values())
