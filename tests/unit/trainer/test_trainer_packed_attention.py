"""The CUDA attention choices for a packed row (trainer/forward/packed_attention.py): `trainer.attention=flex`
and `varlen_attn`, on CPU.

flex_attention runs on CPU uncompiled and forward only (no CPU backward): its output is checked
against the per-sequence SDPA path (the default) and a float64 reference, through the real
document block mask, also inside a transformers model; the block mask's tiles against the dense
[T, T] mask they summarise. varlen_attn has no CPU kernel: the arguments the wrapper builds for
it (both signatures torch has had) are checked by running them through a reference of the
documented semantics. The trainers refuse both on CPU, naming the override. Their backward runs
on CUDA: tests/gpu/test_trainer_kernels_gpu.py and bench/trainer/gpu_trainer.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from areal_jobs.config import Attention
from areal_jobs.trainer.forward.attention import (
    HF_NAMES,
    causal_attention_per_sequence,
    hf_attn_implementation,
    packed_causal_attention,
)
from areal_jobs.trainer.forward.hf_logprobs import token_logprobs
from areal_jobs.trainer.forward.packed_attention import (
    FLEX_BLOCK,
    PackedLayout,
    bucket_length,
    check_attention_device,
    document_block_mask,
    document_block_tiles,
    document_ids,
    layout_of,
    varlen_attn_arguments,
)
from areal_jobs.trainer.intake.batch import TrainSample

# sequences of 1 token, several tiles, exactly one tile, crossing tile edges; 9 + 300 + 128 + 2 + 61
BOUNDS = [0, 1, 10, 310, 438, 440, 501]


def dense_mask(doc: torch.Tensor) -> torch.Tensor:
    q = torch.arange(doc.numel())
    return (doc[:, None] == doc[None, :]) & (q[:, None] >= q[None, :])


@pytest.mark.parametrize("bounds", [BOUNDS, [0, 512], [0, 128, 256], [0, 1], [0, 700, 1000, 1024]])
def test_block_tiles_summarise_the_dense_document_mask(bounds):
    padded = bucket_length(bounds[-1])
    doc = document_ids(bounds, padded)
    assert doc.numel() == padded and int(doc[-1]) == len(bounds) - 1 - (padded == bounds[-1])
    partial, full = document_block_tiles(doc)
    tiles = dense_mask(doc).view(padded // FLEX_BLOCK, FLEX_BLOCK, padded // FLEX_BLOCK, FLEX_BLOCK)
    any_pair, all_pairs = tiles.any(3).any(1), tiles.all(3).all(1)
    assert torch.equal(full, all_pairs)
    assert torch.equal(partial, any_pair & ~all_pairs)
    # flex_attention's own dense view of the mask: every tile with an allowed pair
    mask = document_block_mask(bounds, padded, "cpu")
    assert torch.equal(mask.to_dense()[0, 0].bool(), any_pair)


def test_bucket_lengths_and_layouts():
    assert [bucket_length(t) for t in (1, 511, 512, 513, 32768)] == [512, 512, 512, 1024, 32768]
    cu = torch.tensor(BOUNDS)
    layout = layout_of(cu)
    assert layout.bounds == BOUNDS and layout.max_len == 300
    assert layout_of(cu) is layout  # every layer of one forward shares it (and its block mask)
    assert torch.equal(layout.cu_seqlens(torch.device("cpu")), cu.int())
    positions = torch.cat([torch.arange(b - a) for a, b in zip(BOUNDS[:-1], BOUNDS[1:])])[None]
    assert layout_of(position_ids=positions).bounds == BOUNDS
    with pytest.raises(ValueError, match="shorter than the row"):
        document_ids(BOUNDS, 500)


def qkv(dtype=torch.float32, heads=4, groups=2, d=16):
    g = torch.Generator().manual_seed(7)
    t = BOUNDS[-1]
    return [torch.randn(t, h, d, generator=g, dtype=dtype) for h in (heads, groups, groups)]


def attend(kind: Attention, tensors):
    with torch.no_grad():
        return packed_causal_attention(*tensors, PackedLayout(list(BOUNDS)), kind, scale=0.3)


def test_flex_equals_per_sequence_sdpa():
    """Exact up to summation order: both within a few float32 ulps of the float64 per-sequence
    result (GQA: 4 heads over 2 groups; sequences of 1 to 300 tokens, the row padded to 512)."""
    tensors = qkv()
    flex, varlen = attend(Attention.flex, tensors), attend(Attention.varlen, tensors)
    truth = attend(Attention.varlen, [t.double() for t in tensors])
    assert flex.shape == varlen.shape == (BOUNDS[-1], 4, 16) and flex.is_contiguous()
    eps, scale = torch.finfo(torch.float32).eps, float(truth.abs().max())
    flex_err, varlen_err = (
        float((flex.double() - truth).abs().max()),
        float((varlen.double() - truth).abs().max()),
    )
    print(
        f"flex {flex_err / eps / scale:.1f} float32 ulps of the largest output, per-sequence {varlen_err / eps / scale:.1f}"
    )
    assert flex_err <= 8 * eps * scale and varlen_err <= 8 * eps * scale


@pytest.mark.parametrize("kind", ["varlen_attn", "flex"])
def test_cuda_kinds_are_refused_on_cpu_by_name(kind):
    for device in (None, torch.device("cpu")):
        with pytest.raises(ValueError, match="set trainer.attention=varlen"):
            check_attention_device(kind, device)
    check_attention_device(kind, torch.device("cuda", 0))  # allowed where the kernels are
    check_attention_device("varlen", None)


def test_torch_backend_refuses_them_at_setup(tiny_model_dir):
    from areal_jobs.config import AlgoConfig, DType, TrainerConfig
    from areal_jobs.trainer.torch.backend import TorchBackend

    backend = TorchBackend(
        TrainerConfig(attention=Attention.flex), AlgoConfig(), str(tiny_model_dir), DType.float32
    )
    with pytest.raises(ValueError, match="trainer.attention=flex"):
        backend.setup()


def test_varlen_attn_wrapper_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="CUDA only"):
        packed_causal_attention(*qkv(), PackedLayout(list(BOUNDS)), Attention.varlen_attn, scale=None)


def reference_varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None,
                          window_size=(-1, -1), is_causal=False, enable_gqa=False):  # fmt: skip
    """varlen_attn's documented semantics on CPU: per sequence of cu_q, causal iff window_size is
    (-1, 0) (torch 2.11+) or is_causal (before); key/value heads equal to query's unless enable_gqa."""
    assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    assert enable_gqa or key.shape[1] == query.shape[1]
    causal = tuple(window_size) == (-1, 0) or is_causal
    bounds = cu_q.tolist()
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[a:b].transpose(0, 1)[None] for t in (query, key, value))
        out.append(
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=enable_gqa)[
                0
            ].transpose(0, 1)
        )
    return torch.cat(out)


def old_varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=False):
    """A torch before 2.11 (is_causal) and 2.12 (enable_gqa)."""
    return reference_varlen_attn(
        query, key, value, cu_q, cu_k, max_q, max_k, scale=scale, is_causal=is_causal
    )


@pytest.mark.parametrize("fn", [reference_varlen_attn, old_varlen_attn])
def test_varlen_attn_arguments_ask_for_causal_attention_per_sequence(fn):
    query, key, value = qkv()
    args, kwargs = varlen_attn_arguments(query, key, value, PackedLayout(list(BOUNDS)), 0.3, fn)
    got = fn(*args, **kwargs)
    want = causal_attention_per_sequence(*(t.transpose(0, 1) for t in (query, key, value)), BOUNDS, scale=0.3)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


VOCAB = 97


def tiny_model(attention: Attention):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=hf_attn_implementation(attention))
    with torch.no_grad():  # attention patterns far from uniform
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    return model


def test_hf_flex_logprobs_equal_varlen():
    """The torch backend's packed forward (token_logprobs) with the flex kernel registered: the
    log-probs as with per-sequence attention (a tiny Qwen2, 3 sequences)."""
    rng = np.random.default_rng(5)
    samples = [
        TrainSample(f"s{i}", rng.integers(1, VOCAB, p + n), p, np.zeros(n, np.float32), np.zeros(n, np.int32), 0.0, 0.0)
        for i, (p, n) in enumerate([(3, 40), (1, 1), (20, 150)])
    ]  # fmt: skip
    results = {}
    for kind in (Attention.flex, Attention.varlen):
        model = tiny_model(kind)
        assert model.config._attn_implementation == HF_NAMES[kind]
        with torch.no_grad():
            results[kind] = torch.cat(token_logprobs(model, samples))
    flex, varlen = results[Attention.flex], results[Attention.varlen]
    eps = torch.finfo(torch.float32).eps
    assert float((flex - varlen).abs().max()) <= 8 * eps * float(varlen.abs().max())


def test_megatron_core_attention_takes_the_kind_from_its_layer_spec():
    """Megatron's local spec builds PackedCoreAttention with `kind` (a ModuleSpec param), whose
    THD call (query [t, heads, d]) is the same dispatch."""
    from areal_jobs.trainer.megatron.attention import PackedCoreAttention, _packed
    from areal_jobs.trainer.megatron.convert import ModelDims
    from areal_jobs.trainer.megatron.model import layer_spec

    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": VOCAB,
              "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}  # fmt: skip
    dims = ModelDims.from_hf_config(config, vocab_multiple=128)
    core = layer_spec(
        dims, use_te=False, attention=Attention.flex
    ).submodules.self_attention.submodules.core_attention
    assert core.module is PackedCoreAttention and core.params == {"kind": Attention.flex}
    tensors = qkv()
    with torch.no_grad():
        got = _packed(*tensors, torch.tensor(BOUNDS, dtype=torch.int32), Attention.flex, 0.3, 0.0)
    eps = torch.finfo(torch.float32).eps
    want = attend(Attention.varlen, tensors)
    assert float((got - want).abs().max()) <= 8 * eps * float(want.abs().max())


def test_launch_local_refuses_them_before_any_process_starts(monkeypatch):
    """`make run` with a CUDA-only kind where the trainer runs on the CPU: refused by the launcher."""
    from areal_jobs.config import JobConfig, TrainerBackend, TrainerConfig
    from launch.run import preflight

    with pytest.raises(SystemExit, match="trainer.attention=flex is"):
        preflight.check_trainer_kernels(JobConfig(trainer=TrainerConfig(attention=Attention.flex)))
    preflight.check_trainer_kernels(JobConfig())  # the default: per-sequence SDPA
    monkeypatch.setattr("areal_jobs.rollout.server.cuda_available", lambda: True)
    megatron = TrainerConfig(backend=TrainerBackend.megatron, attention=Attention.varlen_attn)
    preflight.check_trainer_kernels(JobConfig(trainer=megatron))  # trains on the GPU
    with pytest.raises(
        SystemExit, match="trainer.attention=varlen_attn is"
    ):  # trainer=torch trains on the CPU
        preflight.check_trainer_kernels(JobConfig(trainer=TrainerConfig(attention=Attention.varlen_attn)))
