"""Chunked LM-head log-probs and entropy (trainer/forward/logprobs.py) against plain full-vocabulary
autograd: values and gradients, temperature, the entropy gradient, and that no [T, V] tensor is
ever allocated (while the unchunked path does allocate one). The TP=2 vocab-parallel variant is
tests/integration/logprobs/test_logprobs_tp.py."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from float_ulps import assert_within_ulps
from torch.utils._python_dispatch import TorchDispatchMode

from areal_jobs.trainer.forward.hf_logprobs import token_logprobs
from areal_jobs.trainer.forward.logprobs import head_logprobs
from areal_jobs.trainer.intake.batch import TrainSample

N, H, V = 37, 16, 50  # 37 scored tokens: most chunk sizes below do not divide it


def reference(hidden, weight, targets, temperature):
    """What the trainer computed before chunking: float32 logits (float64 if the inputs are),
    log_softmax, gather."""
    logits = (hidden @ weight.T).to(torch.promote_types(hidden.dtype, torch.float32))
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    return logp_all.gather(-1, targets[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


def inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype)
    weight = 0.3 * torch.randn(V, H, generator=g, dtype=dtype)  # logits of order 1, as in a model
    targets = torch.randint(0, V, (N,), generator=g)
    # token-mean loss weights, as the PPO loss gives each token (signs mixed)
    a, b = (torch.randn(N, generator=g, dtype=dtype) / N for _ in range(2))
    return hidden, weight, targets, a, b


def values_and_grads(fn, hidden, weight, a, b, entropy_grad):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy = fn(h, w)
    loss = (logp * a).sum() + ((entropy * b).sum() if entropy_grad else 0.0)
    loss.backward()
    return logp.detach(), entropy.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 5, 16, N, 64, 0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_values_and_gradients_match_full_vocab_autograd(chunk, temperature, entropy_grad):
    hidden, weight, targets, a, b = inputs()
    got = values_and_grads(
        lambda h, w: head_logprobs(
            h, w, targets, temperature=temperature, chunk_tokens=chunk, entropy_grad=entropy_grad
        ),
        hidden, weight, a, b, entropy_grad,
    )  # fmt: skip
    want = values_and_grads(
        lambda h, w: reference(h, w, targets, temperature), hidden, weight, a, b, entropy_grad
    )
    for name, g, w in zip(("logp", "entropy", "d hidden", "d weight"), got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("chunk", [3, 16])
def test_formulas_are_exact_in_float64(chunk):
    """In float64 rounding is out of the way: the chunked backward's closed forms (log-prob and
    entropy gradients, temperature) must equal autograd's to 1e-12."""
    hidden, weight, targets, a, b = inputs(torch.float64, seed=1)
    got = values_and_grads(
        lambda h, w: head_logprobs(h, w, targets, temperature=0.6, chunk_tokens=chunk, entropy_grad=True),
        hidden, weight, a, b, True,
    )  # fmt: skip
    want = values_and_grads(lambda h, w: reference(h, w, targets, 0.6), hidden, weight, a, b, True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)


def test_entropy_is_detached_unless_asked():
    hidden, weight, targets, _, _ = inputs()
    h = hidden.requires_grad_()
    for chunk in (0, 8):
        logp, entropy = head_logprobs(h, weight, targets, chunk_tokens=chunk)
        assert logp.requires_grad and not entropy.requires_grad
        _, entropy = head_logprobs(h, weight, targets, chunk_tokens=chunk, entropy_grad=True)
        assert entropy.requires_grad


def test_temperature_is_an_exact_logit_scaling():
    """softmax(z / t): doubling the hidden states at t=2 (exact in binary floating point) gives
    bit-identical results to t=1, and t=1 to the default (no scaling)."""
    hidden, weight, targets, _, _ = inputs()
    base = head_logprobs(hidden, weight, targets, chunk_tokens=8)
    for t, scale in ((1.0, 1.0), (2.0, 2.0), (0.5, 0.5)):
        got = head_logprobs(hidden * scale, weight, targets, temperature=t, chunk_tokens=8)
        assert all(torch.equal(g, b) for g, b in zip(got, base, strict=True)), t
    cooler = head_logprobs(hidden, weight, targets, temperature=0.7, chunk_tokens=8)
    assert not torch.equal(cooler[0], base[0])


def test_padded_vocabulary_rows_are_left_out():
    """num_valid excludes the padding rows of a (Megatron-padded) weight: same as the real rows
    alone, and the padding gets no gradient."""
    hidden, weight, targets, a, _ = inputs()
    padded = torch.cat([weight, 5.0 * torch.randn(14, H)])
    got = values_and_grads(
        lambda h, w: head_logprobs(h, w, targets, chunk_tokens=7, num_valid=V), hidden, padded, a, a, False
    )
    want = values_and_grads(lambda h, w: reference(h, w, targets, 1.0), hidden, weight, a, a, False)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[3][:V], want[3], atol=1e-6, rtol=1e-6)
    assert torch.equal(got[3][V:], torch.zeros(14, H))


def test_bad_arguments_name_the_override():
    hidden, weight, targets, _, _ = inputs()
    with pytest.raises(ValueError, match="trainer.logprob_chunk_tokens"):
        head_logprobs(hidden, weight, targets, chunk_tokens=-1)
    with pytest.raises(ValueError, match="rollout.temperature"):
        head_logprobs(hidden, weight, targets, temperature=0.0)


class LargestVocabTensor(TorchDispatchMode):
    """Records the largest tensor with a vocabulary-sized last dimension that any op creates
    (forward and backward: autograd runs CPU backward ops on this thread, inside the mode)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.largest = vocab, (0, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab:
                if t.numel() > self.largest[0]:
                    self.largest = (t.numel(), tuple(t.shape))
        return out


class LiveChunkTensors(TorchDispatchMode):
    """The most [chunk, V]-sized buffers alive at once (distinct storages, tracked by weak
    references, views counted once), over every op run inside the mode."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.alive, self.most = numel, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.alive.append(weakref.ref(t))
        live = {r().untyped_storage().data_ptr() for r in self.alive if r() is not None}
        self.most = max(self.most, len(live))
        return out


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_at_most_two_chunk_buffers_live_at_once(entropy_grad):
    """Forward: a chunk's logits and their exp; backward: its log-probs and probabilities (turned
    into dz in place). The previous chunk's dz must be gone before the next chunk's logits exist:
    kept alive across the loop it was a third [c, V] float32 buffer at the backward's peak."""
    torch.manual_seed(0)
    n, h, v, chunk = 40, 8, 500, 16
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    with LiveChunkTensors(chunk * v) as seen:
        logp, entropy = head_logprobs(hidden, weight, targets, chunk_tokens=chunk, entropy_grad=entropy_grad)
        (logp.sum() + entropy.sum() if entropy_grad else logp.sum()).backward()
    assert seen.most == 2


def tiny_qwen2(vocab: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).float()


def samples_of(lengths, vocab, prompt=4, seed=0):
    rng = np.random.default_rng(seed)
    return [
        TrainSample(f"s{i}", rng.integers(1, vocab, n), prompt, np.zeros(n - prompt, np.float32),
                    np.zeros(n - prompt, np.int32), 1.0, 0.0)
        for i, n in enumerate(lengths)
    ]  # fmt: skip


@pytest.mark.parametrize("chunk", [0, 64])
def test_no_tokens_by_vocab_tensor_in_forward_and_backward(chunk):
    """The trainer's whole log-prob path (HF forward, head, backward) on 4 packed sequences:
    chunked, no tensor of [scored tokens, V] exists (the largest vocab-shaped one is a chunk);
    unchunked (the old path), one does. A regression to full logits fails the first case."""
    vocab = 1000  # distinct from every other dimension of the model
    model = tiny_qwen2(vocab)
    samples = samples_of([70, 90, 50, 110], vocab)
    num_scored = sum(s.num_output_tokens for s in samples)  # 304
    with LargestVocabTensor(vocab) as seen:
        logp, entropy = token_logprobs(model, samples, with_entropy=True, chunk_tokens=chunk)
        torch.cat(logp).sum().backward()
    numel, shape = seen.largest
    if chunk:
        assert numel <= chunk * vocab, shape
    else:
        assert numel >= num_scored * vocab, shape


@pytest.mark.parametrize("chunk", [5, 0])
def test_token_logprobs_match_the_models_own_logits(chunk):
    """The packed, chunked (and the unchunked), tempered path equals log_softmax(model(...).logits / t)
    per sample."""
    vocab = 300
    model = tiny_qwen2(vocab).eval()
    exact = tiny_qwen2(vocab).double().eval()  # the same weights in float64: the reference
    samples = samples_of([12, 30, 7], vocab, prompt=3)

    def reference(m, s, t):
        ids = torch.as_tensor(s.input_ids)[None]
        logp = torch.log_softmax(m(ids).logits[0, s.num_prompt_tokens - 1 : -1] / t, -1)
        return logp.gather(-1, ids[0, s.num_prompt_tokens :, None])[:, 0], -(logp.exp() * logp).sum(-1)

    with torch.no_grad():
        for t in (1.0, 0.7):
            got, ent = token_logprobs(model, samples, with_entropy=True, temperature=t, chunk_tokens=chunk)
            got, ent = torch.cat(got), torch.cat(ent)
            want, want_ent = (torch.cat(x) for x in zip(*(reference(model, s, t) for s in samples)))
            true, true_ent = (torch.cat(x) for x in zip(*(reference(exact, s, t) for s in samples)))
            # measured (AMD EPYC with ATen's AVX2 and default kernels, MKL_CBWR=COMPATIBLE): at most
            # 4.2 ulps, 1.6 mean for either float32 path (the entropy's sum over the vocabulary the
            # most); a wrong temperature or position is 1e4+ ulps off
            for what, x, truth in (("log-probs", got, true), ("entropy", ent, true_ent),
                                   ("the model's own log-probs", want, true), ("its entropy", want_ent, true_ent)):  # fmt: skip
                assert_within_ulps(x, truth, max_ulps=16, mean_ulps=4, what=f"{what} at t={t}")


def test_build_backend_hands_every_backend_the_rollout_temperature():
    from areal_jobs.config import JobConfig, RolloutConfig, TrainerBackend, TrainerConfig
    from areal_jobs.trainer.backends import build_backend

    attrs = {TrainerBackend.torch: "temperature", TrainerBackend.fsdp: "temperature"}
    attrs[TrainerBackend.megatron] = "_temperature"
    for kind, attr in attrs.items():
        cfg = JobConfig(rollout=RolloutConfig(temperature=0.7), trainer=TrainerConfig(backend=kind))
        assert getattr(build_backend(cfg), attr) == 0.7, kind
