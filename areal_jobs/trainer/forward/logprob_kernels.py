"""The softmax side of the LM head as two Triton kernels (`trainer.logprob_kernel=triton`).

trainer/forward/logprobs.py applies the head a chunk of c scored rows at a time. The torch path turns a
chunk's `[c, V]` logits into float32 and passes over them op by op (cast, shift, exp, sums, dot,
gather; in backward exp, products, scatter, scale, cast): 6-10 passes over `[c, V]` float32 each
way. Here each direction is one pass over the logits as the matmul wrote them (bf16 on a GPU):

  forward   `head_stats_kernel`: per row, over the vocabulary in blocks, the online max m, the
            sum of e^(z/T - m), the sum of e^(z/T - m) (z/T - m) (the entropy's numerator) and
            the target's tempered logit: four float32 numbers per row. Combining them across the
            TP group's shards (`combine_shards`) is a few [c]-sized torch ops and the same two
            all-reduces as the torch path.
  backward  `head_dlogits_kernel`: per row and block, dz = (-p (g_logp + g_H (s + H)) + g_logp
            [j = target]) / T with s = z/T - lse and p = e^s, written over the logits in place
            (the weight's dtype), which then feed the two matmuls dh = dz W, dW += dz^T h.

What stays torch: the matmuls `h W^T` (forward, and again in backward: the logits are recomputed,
not kept) and `dz W`, `dz^T h` (cuBLAS), and the [c]-sized combination. Nothing `[c, V]` in float32
exists: per chunk one `[c, V]` buffer in the weight's dtype (the logits, then their gradient).

Float32 statistics for float32/bf16/fp16 logits; float64 for float64 (the unit tests' exact checks).
On CUDA the kernels are compiled; on CPU tensors they run through Triton's interpreter, which
TRITON_INTERPRET=1 selects when the process starts (slow: the unit tests and the CPU smoke).
"""

from __future__ import annotations

import importlib.util

import torch

try:  # Triton is optional: the torch path needs none of it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every install the project makes has it
    triton = None

# columns per block on a GPU: 4,096 float32 over 8 warps is 16 registers a thread, and the
# 151,936-token vocabulary takes 38 blocks per row
GPU_BLOCK_V = 4096
GPU_NUM_WARPS = 8
# the interpreter (CPU) runs a Python loop per block: wide blocks for speed; the unit tests narrow
# it so that rows span several blocks and end in a partial one
CPU_BLOCK_V = 256


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def head_stats_kernel(Z, stride_z, TGT, OUT, n_cols, temperature, BLOCK_V: tl.constexpr, F64: tl.constexpr):
    """One program per row of Z [rows, n_cols]; OUT [rows, 4] = (m, Σ e^(s-m), Σ e^(s-m)(s-m), s_t)
    with s = z / temperature; s_t = 0 where the target TGT[row] is not a column of this shard."""
    acc = tl.float64 if F64 else tl.float32
    row = tl.program_id(0)
    z_row = Z + row.to(tl.int64) * stride_z
    m = tl.full((), float("-inf"), acc)
    total = tl.zeros((), acc)
    dot = tl.zeros((), acc)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < n_cols
        s = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(acc) / temperature
        m_new = tl.maximum(m, tl.max(s, axis=0))
        # rescale what was summed against the old max; before the first block nothing was
        # (total = 0), where (m - m_new) * total would be -inf * 0
        alpha = tl.exp(m - m_new)
        dot = alpha * (dot + tl.where(total > 0, m - m_new, 0.0) * total)
        shifted = tl.where(inside, s - m_new, 0.0)  # 0, not -inf, past the last column
        e = tl.where(inside, tl.exp(shifted), 0.0)
        total = alpha * total + tl.sum(e, axis=0)
        dot += tl.sum(e * shifted, axis=0)
        m = m_new
    t = tl.load(TGT + row)
    own = (t >= 0) & (t < n_cols)
    s_t = tl.load(z_row + tl.where(own, t, 0)).to(acc) / temperature
    out = OUT + row.to(tl.int64) * 4
    tl.store(out, m)
    tl.store(out + 1, total)
    tl.store(out + 2, dot)
    tl.store(out + 3, tl.where(own, s_t, 0.0))


def head_dlogits_kernel(
    Z, stride_z, TGT, LSE, ENT, GL, GH, n_cols, temperature,
    HAS_GH: tl.constexpr, BLOCK_V: tl.constexpr, F64: tl.constexpr,
):  # fmt: skip
    """One program per row: Z's logits are overwritten by d loss / d z (Z's dtype), given the row's
    global lse and entropy H (of z / temperature) and the upstream gradients GL (log-prob) and GH
    (entropy, when HAS_GH)."""
    acc = tl.float64 if F64 else tl.float32
    row = tl.program_id(0)
    z_row = Z + row.to(tl.int64) * stride_z
    lse = tl.load(LSE + row).to(acc)
    gl = tl.load(GL + row).to(acc)
    t = tl.load(TGT + row)
    if HAS_GH:
        gh = tl.load(GH + row).to(acc)
        entropy = tl.load(ENT + row).to(acc)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < n_cols
        s = tl.load(z_row + cols, mask=inside, other=0.0).to(acc) / temperature - lse
        p = tl.exp(s)
        if HAS_GH:
            dz = -p * (gl + gh * (s + entropy))
        else:
            dz = -p * gl
        dz = tl.where(cols == t, dz + gl, dz) / temperature
        tl.store(z_row + cols, dz.to(Z.dtype.element_ty), mask=inside)


_compiled: dict[str, object] = {}


def _kernel(fn, device: torch.device):
    """`triton.jit(fn)`: compiled on CUDA; on CPU tensors Triton's interpreter, which must be
    chosen before Triton is imported (TRITON_INTERPRET=1: its standard library is jitted at import)."""
    if triton is None:
        raise RuntimeError(
            "trainer.logprob_kernel=triton needs the triton package: install it or set "
            "trainer.logprob_kernel=torch"
        )
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            "trainer.logprob_kernel=triton on CPU tensors runs through Triton's interpreter, which "
            "TRITON_INTERPRET=1 in the process's environment selects (set before it starts): set "
            "trainer.logprob_kernel=torch (or auto) on CPU"
        )
    if fn.__name__ not in _compiled:
        _compiled[fn.__name__] = triton.jit(fn)
    return _compiled[fn.__name__]


def interpreting() -> bool:
    """Triton runs kernels through its interpreter (TRITON_INTERPRET=1 when it was imported)."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


def _launch(z: torch.Tensor, block_v: int | None) -> tuple[int, dict]:
    if z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(f"logits must be a row-major [rows, V] tensor, got {tuple(z.shape)} {z.stride()}")
    widest = GPU_BLOCK_V if z.is_cuda else CPU_BLOCK_V
    block = block_v or min(widest, triton.next_power_of_2(max(z.shape[1], 16)))
    extra = {"num_warps": GPU_NUM_WARPS} if z.is_cuda else {}
    return block, extra


def chunk_stats(
    z: torch.Tensor, local_targets: torch.Tensor, temperature: float, *, block_v: int | None = None
) -> torch.Tensor:
    """[rows, 4] statistics (m, Σ e^(s-m), Σ e^(s-m)(s-m), s_target) of s = z / temperature over
    this shard's columns; `local_targets` int64 [rows], outside [0, V) where not on this shard."""
    stat = torch.float64 if z.dtype == torch.float64 else torch.float32
    out = torch.empty(z.shape[0], 4, dtype=stat, device=z.device)
    if z.shape[0] == 0:
        return out
    block, extra = _launch(z, block_v)
    _kernel(head_stats_kernel, z.device)[(z.shape[0],)](
        z, z.stride(0), local_targets, out, z.shape[1], float(temperature),
        BLOCK_V=block, F64=stat == torch.float64, **extra,
    )  # fmt: skip
    return out


def chunk_dlogits_(
    z: torch.Tensor,
    local_targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    *,
    block_v: int | None = None,
) -> torch.Tensor:
    """Overwrites the logits z [rows, V] with the loss's gradient in z's dtype; returns z."""
    if z.shape[0] == 0:
        return z
    block, extra = _launch(z, block_v)
    has_gh = grad_entropy is not None
    _kernel(head_dlogits_kernel, z.device)[(z.shape[0],)](
        z, z.stride(0), local_targets, lse.contiguous(), entropy.contiguous(), grad_logp.contiguous(),
        grad_entropy.contiguous() if has_gh else grad_logp, z.shape[1], float(temperature),
        HAS_GH=has_gh, BLOCK_V=block, F64=lse.dtype == torch.float64, **extra,
    )  # fmt: skip
    return z


def combine_shards(stats: torch.Tensor, inside: torch.Tensor, all_reduce) -> tuple[torch.Tensor, ...]:
    """(log-prob, entropy, lse) [rows] of the whole vocabulary from each shard's chunk_stats rows
    (a shard without real columns passes m = -inf, sums 0). `all_reduce(t, op)` reduces over the TP
    group in place (a no-op on one shard); `inside`: the row's target is on this shard.

    With M the global max and m_r a shard's: Σ e^(s-M) = Σ_r e^(m_r - M) S_r and
    Σ e^(s-M)(s-M) = Σ_r e^(m_r - M) (D_r + (m_r - M) S_r)."""
    import torch.distributed as dist

    m, total, dot, s_t = stats.unbind(1)
    top = m.clone()
    all_reduce(top, dist.ReduceOp.MAX)
    scale = torch.exp(m - top)
    shifted = torch.where(total > 0, dot + (m - top) * total, 0.0)
    sums = torch.stack([total * scale, scale * shifted, torch.where(inside, s_t - top, 0.0)])
    all_reduce(sums, dist.ReduceOp.SUM)
    log_norm = sums[0].log()
    return sums[2] - log_norm, log_norm - sums[1] / sums[0], top + log_norm
