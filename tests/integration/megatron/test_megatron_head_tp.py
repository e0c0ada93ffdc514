"""The vocab-parallel chunked LM head (trainer/forward/logprobs.py, as megatron/head.py calls it) at TP=2
over gloo: two ranks, each with half of a padded vocabulary, against one process's plain
full-vocabulary autograd. Values, the hidden-state gradient (all-reduced in the backward) and each
rank's weight-shard gradient; padded rows excluded and without gradient, including a rank whose
shard is all padding. ~5 s: two spawned processes, no model."""

from __future__ import annotations

import pytest
from harness import run_ranks

pytestmark = pytest.mark.megatron

PADDED, H, N = 256, 16, 45
# (real vocabulary, chunk tokens, temperature, entropy gradient): 200 puts 72 real rows on rank 1;
# 100 leaves rank 1 nothing but padding
CASES = [(200, 8, 1.0, False), (200, 7, 0.7, True), (100, 16, 1.3, True)]


def tp_worker(rank: int, world: int, cases: list) -> list[dict[str, float]]:
    import torch
    import torch.distributed as dist

    from areal_jobs.trainer.forward.logprobs import head_logprobs

    dist.init_process_group("gloo")
    per_rank = PADDED // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    out = []
    for num_valid, chunk, temperature, entropy_grad in cases:
        g = torch.Generator().manual_seed(num_valid + chunk)  # the same tensors on every rank
        hidden = torch.randn(N, H, generator=g)
        weight = 0.3 * torch.randn(PADDED, H, generator=g)
        targets = torch.randint(0, num_valid, (N,), generator=g)
        a, b = (torch.randn(N, generator=g) / N for _ in range(2))

        h, w = hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_()
        logp, entropy = head_logprobs(
            h, w, targets, temperature=temperature, chunk_tokens=chunk, entropy_grad=entropy_grad,
            num_valid=num_valid, vocab_start=rows.start, tp_group=dist.group.WORLD,
        )  # fmt: skip
        ((logp * a).sum() + ((entropy * b).sum() if entropy_grad else 0.0)).backward()

        rh, rw = hidden.clone().requires_grad_(), weight[:num_valid].clone().requires_grad_()
        ref = torch.log_softmax((rh @ rw.T) / temperature, dim=-1)
        ref_logp, ref_entropy = ref.gather(-1, targets[:, None])[:, 0], -(ref.exp() * ref).sum(-1)
        ((ref_logp * a).sum() + ((ref_entropy * b).sum() if entropy_grad else 0.0)).backward()
        ref_w_grad = torch.cat([rw.grad, torch.zeros(PADDED - num_valid, H)])[rows]
        out.append(
            {
                # relative above 1: an entropy of ~5.3 has float32 steps of 4.8e-7
                "logp": float(((logp - ref_logp).abs() / ref_logp.abs().clamp(min=1)).max()),
                "entropy": float(((entropy - ref_entropy).abs() / ref_entropy.abs().clamp(min=1)).max()),
                "d hidden": float((h.grad - rh.grad).abs().max()),
                "d weight shard": float((w.grad - ref_w_grad).abs().max()),
                "padded rows grad": float(w.grad[max(0, num_valid - rows.start) :].abs().sum()),
            }
        )
    return out


def test_vocab_parallel_head_matches_one_process_at_tp2():
    results = run_ranks(tp_worker, 2, CASES, timeout_s=120)
    for rank, per_case in enumerate(results):
        for case, diffs in zip(CASES, per_case, strict=True):
            print(rank, case, {k: f"{v:.1e}" for k, v in diffs.items()})
            assert diffs["padded rows grad"] == 0.0, (rank, case)
            assert max(diffs.values()) < 1e-6, (rank, case, diffs)
