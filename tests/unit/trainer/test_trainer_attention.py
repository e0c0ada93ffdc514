"""trainer.attention=varlen (trainer/forward/attention.py): per-sequence causal attention over a packed row
is exact against the dense block-diagonal mask, in the kernel and through transformers' Llama,
Qwen2 and Qwen3 (GQA: 4 query heads, 2 KV groups), and no [T, T] tensor is allocated on the way.

The batch packs very different lengths into one row (a 1-token prompt, a 1-token answer, a
sequence of ~200 tokens beside ones of 2), as the trainer's micro-batches do.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from areal_jobs.config import Attention
from areal_jobs.trainer.forward.attention import (
    HF_VARLEN,
    bounds_of,
    causal_attention_per_sequence,
    hf_attn_implementation,
)
from areal_jobs.trainer.forward.hf_logprobs import token_logprobs
from areal_jobs.trainer.intake.batch import TrainSample

# Both paths are judged against a float64 forward of the same weights, in float32 ulps of each
# true log-prob (np.spacing: 4.8e-7 for the -4..-7 here), so the bound follows the rounding, not
# one CPU's kernels. Measured (one torch thread, AMD EPYC; ATen's AVX2 and default kernels, MKL
# with and without MKL_CBWR=COMPATIBLE): max 1.9-4.0 ulps, mean 0.54-0.61, varlen and dense alike; the absolute |varlen - dense| of 9.5e-7 max / 1.2-1.5e-7 mean that
# AMD gives had passed a 1e-6 / 1e-7 bound on Intel only. A leak between sequences or a wrong
# causal mask moves log-probs by 1e-2 and more: 2e4 ulps.
ULP_MAX = 8.0
ULP_MEAN = 1.5
LENGTHS = [(1, 6), (5, 1), (40, 170), (2, 3), (9, 30)]  # (prompt, answer) tokens
VOCAB = 150


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as a trainer process runs by default (trainer.threads=1): the kernels'
    work split, and so their rounding, does not depend on the pool size."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dense_reference(q, k, v, bounds, scale):
    segment = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(np.diff(bounds)))
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    mask = (segment[:, None] == segment[None, :]) & causal
    # 4-D, as the backends' dense path calls it (the fused kernel; 3-D would take the math path)
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
    )[0]


def test_per_sequence_attention_equals_the_block_diagonal_mask_forward_and_backward():
    torch.manual_seed(0)
    bounds = [0, 1, 38, 41, 161, 163]  # lengths 1, 37, 3, 120, 2
    inputs = [torch.randn(h, bounds[-1], 16, requires_grad=True) for h in (4, 2, 2)]
    weight = torch.randn(4, bounds[-1], 16)  # a random upstream gradient
    got = causal_attention_per_sequence(*inputs, bounds, scale=0.3).transpose(0, 1)  # [heads, T, d]
    assert got.transpose(0, 1).is_contiguous()
    grads = torch.autograd.grad((got * weight).sum(), inputs)
    want = dense_reference(*inputs, bounds, 0.3)
    want_grads = torch.autograd.grad((want * weight).sum(), inputs)
    assert (got - want).abs().max() < 4e-6  # measured 1.2e-6: flash kernel per sequence vs math
    for g, w in zip(grads, want_grads, strict=True):
        assert (g - w).abs().max() < 1e-5


def test_bounds_from_cu_seqlens_or_restarting_positions():
    positions = torch.tensor([[0, 1, 2, 0, 0, 1]])
    assert bounds_of(position_ids=positions) == [0, 3, 4, 6]
    assert bounds_of(cu_seqlens=torch.tensor([0, 3, 4, 6])) == [0, 3, 4, 6]
    with pytest.raises(ValueError, match="do not cover"):
        causal_attention_per_sequence(
            torch.zeros(2, 6, 4), torch.zeros(2, 6, 4), torch.zeros(2, 6, 4), [0, 5], scale=None
        )


def tiny_model(family: str, attention: Attention):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=family == "qwen2",
    )
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=hf_attn_implementation(attention), dtype=torch.float32
    )
    with torch.no_grad():  # larger than the init's weights: attention patterns far from uniform
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    return model.eval()


def samples():
    rng = np.random.default_rng(5)
    return [
        TrainSample(
            f"s{i}",
            rng.integers(1, VOCAB, p + n),
            p,
            np.zeros(n, np.float32),
            np.zeros(n, np.int32),
            0.0,
            0.0,
        )
        for i, (p, n) in enumerate(LENGTHS)
    ]


class SquareTensors(TorchDispatchMode):
    """Records every op output with two dimensions of `size` (a [T, T] mask or score matrix).
    Under a dispatch mode SDPA runs its math decomposition, which shows its score matrices."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.found = size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and list(t.shape).count(self.size) >= 2:
                self.found.append((str(func), tuple(t.shape)))
        return out


def test_per_sequence_attention_runs_the_fused_kernel_without_score_matrices():
    """Each sequence's [heads, l, l] scores would exist on the math path (3-D inputs take it):
    forward and backward of a 120-token sequence must allocate none."""
    torch.manual_seed(0)
    bounds = [0, 1, 38, 41, 161, 163]
    inputs = [torch.randn(h, bounds[-1], 16, requires_grad=True) for h in (4, 2, 2)]
    probe = SquareTensors(120)
    with probe:
        out = causal_attention_per_sequence(*inputs, bounds, scale=0.3)
        torch.autograd.grad(out.sum(), inputs)
    assert probe.found == []


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_hf_varlen_logprobs_equal_dense_and_no_tensor_is_t_by_t(family):
    dense, varlen = tiny_model(family, Attention.dense), tiny_model(family, Attention.varlen)
    assert varlen.config._attn_implementation == HF_VARLEN
    batch = samples()
    with torch.no_grad():
        want, got = (torch.cat(token_logprobs(m, batch)) for m in (dense, varlen))
        truth = torch.cat(token_logprobs(tiny_model(family, Attention.dense).double(), batch))
    assert got.shape == want.shape == truth.shape == (sum(n for _, n in LENGTHS),)
    ulp = torch.from_numpy(np.spacing(truth.abs().numpy().astype(np.float32)).astype(np.float64))
    errors = {name: (x.double() - truth).abs() / ulp for name, x in (("varlen", got), ("dense", want))}
    print(
        f"{family}: error vs float64 in float32 ulps: "
        + ", ".join(f"{k} max {float(e.max()):.1f} mean {float(e.mean()):.2f}" for k, e in errors.items())
    )
    for name, error in errors.items():  # dense too: the check of the float64 reference itself
        assert error.max() <= ULP_MAX and error.mean() <= ULP_MEAN, (name, error.max(), error.mean())
    num_tokens = sum(len(s.input_ids) for s in batch)
    with SquareTensors(num_tokens) as varlen_ops:
        torch.cat(token_logprobs(varlen, batch)).sum().backward()  # the gradients' buffers too
    assert varlen_ops.found == []
    with SquareTensors(num_tokens) as dense_ops:  # the check can fail: the dense path builds [T, T]
        token_logprobs(dense, batch)
    assert dense_ops.found


def test_hf_varlen_finds_the_sequences_from_position_ids_alone():
    """A caller that passes only the restarting position ids (no cu_seq_lens_q) gets the same."""
    from areal_jobs.trainer.intake.packing import pack

    model = tiny_model("qwen2", Attention.varlen)
    packed = pack([s.input_ids for s in samples()])
    ids = torch.from_numpy(packed.input_ids)[None]
    positions = torch.from_numpy(packed.position_ids)[None]
    with torch.no_grad():
        bare = model(input_ids=ids, position_ids=positions).logits
        told = model(
            input_ids=ids, position_ids=positions, cu_seq_lens_q=torch.as_tensor(packed.cu_seqlens)
        ).logits
    assert torch.equal(bare, told)


def test_hf_varlen_refuses_a_padded_batch():
    model = tiny_model("llama", Attention.varlen)
    with pytest.raises(ValueError, match="batch 1"):
        model(input_ids=torch.ones(2, 5, dtype=torch.long))


def test_generate_on_a_varlen_model_equals_sdpa():
    """The trainer's model decodes (evaluation, greedy references): its KV-cache steps attend to
    every cached key, so greedy generation equals the sdpa model's token for token; a batch of
    padded prompts is refused with the fix."""
    dense, varlen = tiny_model("qwen2", Attention.dense), tiny_model("qwen2", Attention.varlen)
    prompt = torch.tensor([[5, 17, 3, 42, 9, 11]])
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want, got = (m.generate(prompt, **kwargs) for m in (dense, varlen))
    assert got.shape == (1, 18) and torch.equal(got, want)
    with pytest.raises(ValueError, match="one packed row|load the model with sdpa"):
        with torch.no_grad():
            varlen.generate(
                torch.tensor([[5, 17, 3], [0, 42, 9]]),
                attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]]),
                **kwargs,
            )
