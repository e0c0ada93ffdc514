"""The trainer's CUDA kernels against their torch paths, on a GPU (`make test-gpu`; ~1 minute).

  - the fused Triton log-prob head (trainer.logprob_kernel=triton) against the chunked torch head at
    the real vocabulary (151,936) and Qwen2-1.5B's width, float32 and bf16, values and gradients,
    with the entropy's gradient; and the time of each head's forward + backward, printed;
  - varlen_attn and compiled FlexAttention (trainer.attention) against per-sequence SDPA, forward
    and backward, bf16, GQA, sequences of 1 to 3,000 tokens (on CPU only their forward or their
    arguments can be checked: FlexAttention has no CPU backward, varlen_attn no CPU kernel).
Tolerances follow the dtype: float32 as the CPU tests (the same formulas, other summation order),
bf16 within 4 bf16 ulps of the largest entry (each path rounds its bf16 gradient once; the
interpreter test measured 1.7 at small shapes).
Every test is skipped without CUDA.
"""

from __future__ import annotations

import time

import pytest
import torch

from areal_jobs.config import Attention
from areal_jobs.trainer.forward.attention import packed_causal_attention
from areal_jobs.trainer.forward.logprobs import head_logprobs
from areal_jobs.trainer.forward.packed_attention import PackedLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

V, H, N = 151936, 1536, 2048


def head_run(kernel, hidden, weight, targets, a, b):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy = head_logprobs(
        h, w, targets, temperature=0.9, chunk_tokens=1024, entropy_grad=True, kernel=kernel
    )
    ((logp * a).sum() + (entropy * b).sum()).backward()
    return [logp.detach(), entropy.detach(), h.grad, w.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_head_matches_the_torch_head(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, H, device="cuda", generator=g).to(dtype)
    weight = (0.02 * torch.randn(V, H, device="cuda", generator=g)).to(dtype)
    targets = torch.randint(0, V, (N,), device="cuda", generator=g)
    a, b = (torch.randn(N, device="cuda", generator=g) / N for _ in range(2))
    fused, plain = (
        head_run("triton", hidden, weight, targets, a, b),
        head_run("torch", hidden, weight, targets, a, b),
    )
    assert float(fused[0].max()) <= 0.0 and all(bool(torch.isfinite(t).all()) for t in fused)
    eps = torch.finfo(dtype).eps
    for name, f, p in zip(("logp", "entropy", "d hidden", "d weight"), fused, plain, strict=True):
        scale = float(p.float().abs().max())
        err = float((f.float() - p.float()).abs().max())
        # values: float32 statistics of the same logits in both (log V ~ 12: 4 float32 ulps of 16)
        bound = 4 * torch.finfo(torch.float32).eps * 16 if name in ("logp", "entropy") else 4 * eps * scale
        print(f"[gpu] head {dtype}: {name} max |fused - torch| {err:.2e} (bound {bound:.2e})")
        assert err <= bound, name
    for kernel in ("torch", "triton"):  # timing, printed: no assertion
        head_run(kernel, hidden, weight, targets, a, b)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            head_run(kernel, hidden, weight, targets, a, b)
        torch.cuda.synchronize()
        print(
            f"[gpu] head {dtype} {kernel}: {(time.perf_counter() - t0) / 3 * 1e3:.1f} ms forward + backward, {N} rows"
        )


BOUNDS = [0, 1, 700, 3700, 3711, 5000, 5003]


@pytest.mark.parametrize("kind", [Attention.varlen_attn, Attention.flex])
def test_packed_kernels_match_per_sequence_sdpa_forward_and_backward(kind):
    g = torch.Generator(device="cuda").manual_seed(1)
    t = BOUNDS[-1]
    tensors = [torch.randn(t, h, 128, device="cuda", generator=g, dtype=torch.bfloat16) for h in (12, 2, 2)]
    weights = torch.randn(t, 12, 128, device="cuda", generator=g, dtype=torch.bfloat16)

    def run(which):
        inputs = [x.clone().requires_grad_() for x in tensors]
        out = packed_causal_attention(*inputs, PackedLayout(list(BOUNDS)), which, scale=128**-0.5)
        (out.float() * weights.float()).sum().backward()
        return [out.detach(), *(x.grad for x in inputs)]

    got, want = run(kind), run(Attention.varlen)
    eps = torch.finfo(torch.bfloat16).eps
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        scale, err = float(y.float().abs().max()), float((x.float() - y.float()).abs().max())
        print(f"[gpu] {kind.value}: {name} max |diff| {err:.2e} of {scale:.2e}")
        assert err <= 4 * eps * scale, name
