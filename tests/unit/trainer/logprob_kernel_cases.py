"""The Triton log-prob head's cases, run through Triton's interpreter in a process of their own.

    TRITON_INTERPRET=1 python tests/unit/trainer/logprob_kernel_cases.py

(test_trainer_logprob_kernels.py runs it: the interpreter must be chosen before Triton is
imported, which the test process cannot do without changing it for every other test.) Prints one
line `RESULT {json}`: per case the largest errors against its reference and the sanity flags
(positive log-prob, non-finite value); the test asserts on them. Small shapes, several vocabulary
blocks per row ending in a partial one (CPU_BLOCK_V = 16, V = 50), chunks that do not divide N.
"""

from __future__ import annotations

import json
import math
import socket
import sys
import threading

import torch

N, H, V = 37, 16, 50
PADDED = 64  # a Megatron-padded vocabulary of V real rows: 2 TP shards of 32, rank 1 18 real
CHUNK = 16


def inputs(dtype=torch.float32, seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = 0.3 * torch.randn(vocab, H, generator=g, dtype=torch.float64)
    targets = torch.randint(0, min(vocab, V), (N,), generator=g)
    a, b = (torch.randn(N, generator=g, dtype=torch.float64) / N for _ in range(2))
    return hidden.to(dtype), weight.to(dtype), targets, a, b


def run_head(kernel, hidden, weight, targets, a, b, *, temperature, entropy_grad, chunk=CHUNK, **kw):
    from areal_jobs.trainer.forward.logprobs import head_logprobs

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy = head_logprobs(
        h, w, targets, temperature=temperature, chunk_tokens=chunk, entropy_grad=entropy_grad,
        kernel=kernel, **kw,
    )  # fmt: skip
    loss = (logp * a.to(logp.dtype)).sum() + ((entropy * b.to(entropy.dtype)).sum() if entropy_grad else 0.0)
    loss.backward()
    return logp.detach(), entropy.detach(), h.grad, w.grad


def sanity(logp, entropy, *grads) -> dict:
    values = [logp, entropy, *grads]
    return {
        "max_logp": float(logp.max()),  # a log-probability is <= 0
        "min_entropy": float(entropy.min()),
        "max_entropy": float(entropy.max()),
        "all_finite": all(bool(torch.isfinite(t).all()) for t in values),
    }


def errors(got, want) -> dict:
    """Largest |got - want| of each output, and each output's largest |want| (the scale)."""
    names = ("logp", "entropy", "d_hidden", "d_weight")
    out = {}
    for name, g, w in zip(names, got, want, strict=True):
        out[f"{name}_err"] = float((g.double() - w.double()).abs().max())
        out[f"{name}_scale"] = float(w.double().abs().max())
    return out


def case_float64_exact(temperature, entropy_grad):
    """float64 kernels against plain float64 autograd: the formulas, rounding out of the way."""
    from areal_jobs.trainer.forward.logprobs import full_vocab_logprobs

    hidden, weight, targets, a, b = inputs(torch.float64, seed=1)
    got = run_head(
        "triton", hidden, weight, targets, a, b, temperature=temperature, entropy_grad=entropy_grad
    )
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy = full_vocab_logprobs(h, w, targets, temperature)
    ((logp * a).sum() + ((entropy * b).sum() if entropy_grad else 0.0)).backward()
    want = (logp.detach(), entropy.detach(), h.grad, w.grad)
    return {**errors(got, want), **sanity(*got)}


def case_float32(temperature, entropy_grad):
    """float32 kernels against the float64 truth and against the torch chunked path in float32."""
    hidden, weight, targets, a, b = inputs(torch.float32)
    kw = dict(temperature=temperature, entropy_grad=entropy_grad)
    got = run_head("triton", hidden, weight, targets, a, b, **kw)
    truth = run_head("torch", hidden.double(), weight.double(), targets, a, b, **kw)
    torch_path = run_head("torch", hidden, weight, targets, a, b, **kw)
    out = {f"truth_{k}": v for k, v in errors(got, truth).items()}
    out.update({f"torch_{k}": v for k, v in errors(got, torch_path).items()})
    return {**out, **sanity(*got)}


def case_bfloat16():
    """bf16 weights (the GPU's dtype): the kernels read the bf16 logits the matmul wrote, as the
    torch path casts them; both gradients are cast to bf16 before the matmuls."""
    hidden, weight, targets, a, b = inputs(torch.bfloat16, seed=2)
    kw = dict(temperature=0.9, entropy_grad=True)
    got = run_head("triton", hidden, weight, targets, a, b, **kw)
    want = run_head("torch", hidden, weight, targets, a, b, **kw)
    return {**errors(got, want), **sanity(*got)}


def case_padded_vocabulary():
    """num_valid leaves the padding rows out: equal to the real rows alone, padding without gradient."""
    hidden, weight, targets, a, b = inputs(torch.float32, seed=3, vocab=PADDED)
    kw = dict(temperature=1.0, entropy_grad=True)
    got = run_head("triton", hidden, weight, targets, a, b, num_valid=V, chunk=5, **kw)
    want = run_head("torch", hidden, weight[:V], targets, a, b, chunk=5, **kw)
    out = errors((got[0], got[1], got[2], got[3][:V]), want)
    return {**out, "padding_grad": float(got[3][V:].abs().sum()), **sanity(*got)}


def shard_stats(hidden, weight, targets, temperature, rank, world, num_valid):
    """One TP shard's kernel statistics, as _fused_chunk computes them (its local logits)."""
    from areal_jobs.trainer.forward import logprob_kernels

    per = weight.shape[0] // world
    start = rank * per
    valid = max(0, min(per, num_valid - start))
    local_t = targets - start
    z = hidden @ weight[start : start + valid].T
    stats = logprob_kernels.chunk_stats(z, local_t, temperature) if valid else None
    if stats is None:
        stats = torch.zeros(hidden.shape[0], 4)
        stats[:, 0] = float("-inf")
    return stats, (local_t >= 0) & (local_t < valid)


def combine_in_threads(per_shard):
    """combine_shards on every shard at once, its all-reduces emulated across threads (the
    collectives of one process group, without one): each reduce waits for every shard's tensor."""
    from areal_jobs.trainer.forward.logprob_kernels import combine_shards

    world = len(per_shard)
    slots: list = [None] * world
    barrier = threading.Barrier(world)
    results: list = [None] * world

    def reducer(rank):
        def all_reduce(t, op):
            slots[rank] = t.clone()
            barrier.wait()
            stacked = torch.stack(slots)
            reduced = stacked.amax(0) if op == torch.distributed.ReduceOp.MAX else stacked.sum(0)
            barrier.wait()
            t.copy_(reduced)

        return all_reduce

    def body(rank):
        stats, inside = per_shard[rank]
        results[rank] = combine_shards(stats, inside, reducer(rank))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def case_tp2_emulated():
    """Two vocabulary shards (the second 18 real rows and 14 of padding): each shard's kernel
    statistics combined across shards equal the one-shard values; each shard's gradient kernel
    gives exactly its columns of the one-shard dlogits. `swapped_*`: the same with the shards'
    vocabulary offsets exchanged (a wrong shard), which must not match."""
    from areal_jobs.trainer.forward import logprob_kernels

    hidden, weight, targets, a, _ = inputs(torch.float32, seed=4, vocab=PADDED)
    temperature = 0.8
    one = logprob_kernels.combine_shards(
        logprob_kernels.chunk_stats(hidden @ weight[:V].T, targets, temperature),
        torch.ones(N, dtype=torch.bool),
        lambda t, op: None,
    )
    shards = [shard_stats(hidden, weight, targets, temperature, r, 2, V) for r in range(2)]
    combined = combine_in_threads(shards)
    out = {}
    for rank, (logp, entropy, lse) in enumerate(combined):
        out[f"rank{rank}_logp_err"] = float((logp - one[0]).abs().max())
        out[f"rank{rank}_entropy_err"] = float((entropy - one[1]).abs().max())
        out[f"rank{rank}_lse_err"] = float((lse - one[2]).abs().max())
    # a wrong shard: rank 0 reads rank 1's offsets (its targets shifted by 32), and vice versa
    wrong = [shard_stats(hidden, weight.roll(32, 0), targets, temperature, r, 2, V) for r in range(2)]
    out["swapped_logp_err"] = float((combine_in_threads(wrong)[0][0] - one[0]).abs().max())
    # backward: the full dlogits over the real columns, then each shard's own
    lse, entropy = one[2], one[1]
    full = logprob_kernels.chunk_dlogits_(
        hidden @ weight[:V].T, targets, lse, entropy, a.float(), None, temperature
    )
    err = 0.0
    for rank in range(2):
        start = rank * 32
        valid = max(0, min(32, V - start))
        z = hidden @ weight[start : start + valid].T
        dz = logprob_kernels.chunk_dlogits_(z, targets - start, lse, entropy, a.float(), None, temperature)
        err = max(err, float((dz - full[:, start : start + valid]).abs().max()))
    out["dlogits_shard_err"] = err
    out["dlogits_scale"] = float(full.abs().max())
    out.update(sanity(one[0], one[1]))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_rank(rank: int, world: int, port: int, queue) -> None:
    """A real TP=2 group over gloo: head_logprobs with kernel=triton on this rank's shard."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from areal_jobs.trainer.forward import logprob_kernels

        logprob_kernels.CPU_BLOCK_V = 16
        hidden, weight, targets, a, b = inputs(torch.float32, seed=5, vocab=PADDED)
        per = PADDED // world
        shard = weight[rank * per : (rank + 1) * per]
        kw = dict(temperature=1.2, entropy_grad=True)
        got = run_head("triton", hidden, shard, targets, a, b, num_valid=V, vocab_start=rank * per,
                       tp_group=dist.group.WORLD, chunk=7, **kw)  # fmt: skip
        want = run_head("torch", hidden.double(), weight[:V].double(), targets, a, b, chunk=7, **kw)
        ref_w = torch.cat([want[3], torch.zeros(PADDED - V, H, dtype=torch.float64)])[
            rank * per : (rank + 1) * per
        ]
        out = errors((got[0], got[1], got[2], got[3]), (want[0], want[1], want[2], ref_w))
        out["padding_grad"] = float(got[3][max(0, V - rank * per) :].abs().sum())
        out.update(sanity(*got))
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def case_tp2_gloo():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=gloo_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return {f"rank{r}_{k}": v for r in sorted(results) for k, v in results[r].items()}


def main() -> int:
    from areal_jobs.trainer.forward import logprob_kernels

    if not logprob_kernels.interpreting():
        print("run with TRITON_INTERPRET=1 in the environment", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    logprob_kernels.CPU_BLOCK_V = 16  # rows of 50 columns: 4 blocks, the last partial
    cases = {
        "float64_exact_t0.7_entropy": case_float64_exact(0.7, True),
        "float64_exact_t1": case_float64_exact(1.0, False),
    }
    for t in (1.0, 0.7, 1.3):
        for eg in (False, True):
            cases[f"float32_t{t}_{'entropy' if eg else 'logp'}"] = case_float32(t, eg)
    cases["bfloat16"] = case_bfloat16()
    cases["padded_vocabulary"] = case_padded_vocabulary()
    cases["tp2_emulated"] = case_tp2_emulated()
    cases["tp2_gloo"] = case_tp2_gloo()
    print("RESULT " + json.dumps(cases, allow_nan=True), flush=True)
    return 0


LOG_V = math.log(V)

if __name__ == "__main__":
    sys.exit(main())
