"""Log-probs and entropy of the tempered policy from the final hidden states, chunk by chunk.

At 32k tokens and Qwen2's 151,936-token vocabulary a float32 `[T, V]` logits tensor is ~20 GB, and
plain autograd keeps several (logits, log-softmax, their gradients). Here the LM head is applied
`chunk_tokens` rows at a time inside one autograd Function: the forward keeps only per-row
statistics (log-normaliser, entropy) and the backward recomputes each chunk's logits and turns
them straight into the hidden-state and weight gradients, so at most a few `[chunk, V]` float32
tensors exist at once (AReaL's chunked LM head and verl's fused linear-for-PPO do the same).

Numerics are today's: logits by a matmul in the weight's dtype, then float32, divided by the
sampling temperature (skipped at 1.0, so that is bit-identical to no scaling), log-softmax from
the max-shifted logits. The policy is `softmax(logits / temperature)`, the one that sampled.

Vocab-parallel (Megatron TP): `weight` is this rank's `[V/tp, H]` shard starting at global row
`vocab_start`; rows at or past `num_valid` (the padded vocabulary) are left out. The max and the
sums over the vocabulary are all-reduced over `tp_group`; the hidden-state gradient, a partial sum
per shard, is all-reduced in the backward (what Megatron's ColumnParallelLinear input does).

`kernel="triton"` (trainer.logprob_kernel, `resolve_kernel`): the same chunks, the same matmuls,
but the softmax-side passes over each chunk's logits are two fused Triton kernels
(trainer/forward/logprob_kernels.py): the logits stay in the weight's dtype and no `[c, V]` float32 tensor
exists. Vocab-parallel the same way: each shard's kernel returns its partial max, sums and target
logit, combined over `tp_group` with the same two all-reduces.

No GPU-only import: Triton is imported by logprob_kernels.py only; the TP collectives are plain
torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from areal_jobs.config import LogprobKernel

_SUM, _MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    entropy_grad: bool = False,
    num_valid: int | None = None,
    vocab_start: int = 0,
    tp_group: dist.ProcessGroup | None = None,
    kernel: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of `targets`, entropy), float32 `[N]` each, of `softmax(hidden @ weight.T / temperature)`.

    hidden `[N, H]`: the final hidden states at the N scored positions (differentiable);
    weight `[V_local, H]`: the LM head (this rank's vocab shard under TP); targets int64 `[N]`:
    global token ids. `chunk_tokens` rows at a time (0: all N at once, through plain autograd:
    the full-vocabulary path, kept to measure against). The entropy is detached unless
    `entropy_grad` (an entropy bonus needs d entropy / d theta). num_valid: global vocabulary
    size without padding (None: every row of every shard is real). `kernel`: "torch" or
    "triton" (the fused softmax side; `resolve_kernel` picks it from trainer.logprob_kernel).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (rollout.temperature), got {temperature}")
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 0 (trainer.logprob_chunk_tokens), got {chunk_tokens}")
    if kernel not in ("torch", "triton"):
        raise ValueError(f"kernel must be torch or triton (trainer.logprob_kernel), got {kernel!r}")
    valid = _local_valid(weight.shape[0], num_valid, vocab_start)
    hidden = hidden.to(weight.dtype)  # no-op when they match (a bf16 model's upcast output: lossless)
    if chunk_tokens == 0:
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            raise ValueError("chunk_tokens=0 (the full-vocabulary path) is single-shard only")
        logp, entropy = full_vocab_logprobs(hidden, weight[:valid], targets, temperature)
        return logp, entropy if entropy_grad else entropy.detach()
    logp, entropy = _ChunkedHead.apply(
        hidden, weight, targets, float(temperature), int(chunk_tokens), valid, vocab_start, tp_group,
        kernel == "triton",
    )  # fmt: skip
    return logp, entropy if entropy_grad else entropy.detach()


def resolve_kernel(choice: LogprobKernel, device: torch.device | None) -> str:
    """trainer.logprob_kernel -> "torch" or "triton" for a model on `device` (None: CPU). auto:
    the Triton kernels on CUDA when Triton is importable, else torch (CPU keeps the torch path)."""
    from areal_jobs.trainer.forward.logprob_kernels import triton_available

    on_cuda = device is not None and torch.device(device).type == "cuda"
    if choice is LogprobKernel.auto:
        return "triton" if on_cuda and triton_available() else "torch"
    if choice is LogprobKernel.triton and not triton_available():
        raise ValueError(
            "trainer.logprob_kernel=triton needs the triton package (not importable here): "
            "set trainer.logprob_kernel=torch or auto"
        )
    return choice.value


def full_vocab_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-autograd reference: `[N, V]` float32 logits and log-softmax, as before chunking.
    Differentiable in both outputs."""
    logits = F.linear(hidden, weight)
    logits = logits.to(_stat_dtype(logits.dtype))
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _local_valid(rows: int, num_valid: int | None, vocab_start: int) -> int:
    """How many of this shard's rows are real vocabulary (the rest is padding)."""
    if num_valid is None:
        return rows
    return max(0, min(rows, num_valid - vocab_start))


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 (which the unit tests use to check the formulas exactly)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 (float64 for float64 weights) logits `[c, V_valid]` of one chunk, tempered; a
    fresh tensor, edited in place by the callers."""
    z = F.linear(h, w)
    z = z.to(_stat_dtype(z.dtype)) if z.dtype != _stat_dtype(z.dtype) else z
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _ChunkedHead(torch.autograd.Function):
    """Forward keeps per row only log Σ exp (lse) and the entropy H; backward recomputes logits.

    With s = z - lse (the log-probs of the row) and p = exp(s):
      d logp_t / d z_j = [j = t] - p_j
      d H / d z_j      = -p_j (s_j + H)
    and z = (h W^T) / temperature gives dh = dz W / temperature, dW = dz^T h / temperature.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_tokens, valid, vocab_start, group, fused):
        ctx.set_materialize_grads(False)  # a detached entropy's gradient stays None: no work for it
        n = hidden.shape[0]
        w = weight[:valid]
        stat = _stat_dtype(weight.dtype)
        logp = hidden.new_empty(n, dtype=stat)
        entropy = hidden.new_empty(n, dtype=stat)
        lse = hidden.new_empty(n, dtype=stat)
        local_t = targets - vocab_start
        chunk = _fused_chunk if fused else _torch_chunk
        for lo in range(0, n, chunk_tokens):
            hi = min(n, lo + chunk_tokens)
            logp[lo:hi], entropy[lo:hi], lse[lo:hi] = chunk(
                hidden[lo:hi], w, local_t[lo:hi], temperature, valid, group
            )
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.args = (temperature, chunk_tokens, valid, vocab_start, group, fused)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk_tokens, valid, vocab_start, group, fused = ctx.args
        n = hidden.shape[0]
        w = weight[:valid]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None
        # accumulated over chunks in float32 (the gradient of a bf16 weight too), cast at the end
        stat = _stat_dtype(weight.dtype)
        grad_w = torch.zeros(weight.shape, dtype=stat, device=weight.device) if need_w else None
        g_logp = grad_logp if grad_logp is not None else lse.new_zeros(n)
        local_t = targets - vocab_start
        for lo in range(0, n, chunk_tokens):
            hi = min(n, lo + chunk_tokens)
            if valid == 0:
                break
            h = hidden[lo:hi]
            if fused:
                dz = _fused_chunk_grad(
                    h, w, local_t[lo:hi], lse[lo:hi], entropy[lo:hi], g_logp[lo:hi],
                    None if grad_entropy is None else grad_entropy[lo:hi], temperature,
                )  # fmt: skip
            else:
                dz = _torch_chunk_grad(
                    h, w, local_t[lo:hi], lse[lo:hi], entropy[lo:hi], g_logp[lo:hi],
                    None if grad_entropy is None else grad_entropy[lo:hi], temperature, valid,
                )  # fmt: skip
            dz = dz.to(weight.dtype)
            if need_h:
                grad_h[lo:hi] = dz @ w
            if need_w and dz.dtype == stat:
                grad_w[:valid].addmm_(dz.T, h)
            elif need_w:
                grad_w[:valid].add_(dz.T @ h)
            # freed before the next chunk's logits exist: alive into the next iteration it made a
            # third [c, V] float32 copy at the backward's peak (measured: 1.78 GiB -> 1.17 at c=1024)
            del dz
        if need_h and n:
            _all_reduce(grad_h, _SUM, group)  # each shard holds a partial sum over its columns
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


def _torch_chunk(h, w, local_t, temperature, valid, group):
    """(log-prob, entropy, lse) of one chunk's rows with torch ops over float32 [c, V] logits."""
    rows = h.shape[0]
    z = _chunk_logits(h, w, temperature)  # [c, V_valid]
    top = z.amax(-1) if valid else z.new_full((rows,), float("-inf"))
    _all_reduce(top, _MAX, group)
    z.sub_(top[:, None])  # s = z - max
    e = torch.exp(z)
    inside = (local_t >= 0) & (local_t < valid)
    target_s = (
        z.gather(1, local_t.clamp(0, max(valid - 1, 0))[:, None]).squeeze(1) if valid else e.new_zeros(rows)
    )
    # [Σ e^s, Σ e^s s (a batched dot: no [c, V] product), s_target] in one all-reduce;
    # s_target lives on one shard only
    dot = torch.bmm(e[:, None, :], z[:, :, None])[:, 0, 0]
    sums = torch.stack([e.sum(-1), dot, target_s.where(inside, 0.0)])
    del z, e
    _all_reduce(sums, _SUM, group)
    log_norm = sums[0].log()
    return sums[2] - log_norm, log_norm - sums[1] / sums[0], top + log_norm


def _fused_chunk(h, w, local_t, temperature, valid, group):
    """The same from the Triton statistics kernel over the chunk's logits in w's dtype."""
    from areal_jobs.trainer.forward import logprob_kernels

    rows = h.shape[0]
    if valid:
        stats = logprob_kernels.chunk_stats(F.linear(h, w), local_t, temperature)
    else:  # a shard of padding only: no column, nothing to add
        stats = torch.zeros(rows, 4, dtype=_stat_dtype(w.dtype), device=h.device)
        stats[:, 0] = float("-inf")
    inside = (local_t >= 0) & (local_t < valid)
    return logprob_kernels.combine_shards(stats, inside, lambda t, op: _all_reduce(t, op, group))


def _torch_chunk_grad(h, w, local_t, lse, entropy, gl, gh, temperature, valid):
    """d loss / d z of one chunk in w's dtype, torch ops over float32 [c, V]."""
    s = _chunk_logits(h, w, temperature).sub_(lse[:, None])  # log-probs of the chunk
    p = torch.exp(s)
    gl = gl[:, None]
    if gh is not None:
        # dz = -p (gl + g_H (s + H)), built in s's buffer
        dz = s.add_(entropy[:, None]).mul_(gh[:, None]).add_(gl).mul_(p).neg_()
    else:
        dz = p.mul_(gl).neg_()
    del p, s
    inside = (local_t >= 0) & (local_t < valid)  # the target's column is on this shard
    # + g_logp at the target (a masked scatter: no host sync for a boolean index on GPU)
    dz.scatter_add_(1, local_t.clamp(0, valid - 1)[:, None], gl.where(inside[:, None], 0.0))
    if temperature != 1.0:
        dz.div_(temperature)
    return dz.to(w.dtype)


def _fused_chunk_grad(h, w, local_t, lse, entropy, gl, gh, temperature):
    """The same from the Triton gradient kernel, written over the recomputed logits in place."""
    from areal_jobs.trainer.forward import logprob_kernels

    return logprob_kernels.chunk_dlogits_(F.linear(h, w), local_t, lse, entropy, gl, gh, temperature)
