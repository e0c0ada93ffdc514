"""How one batch splits over data-parallel ranks and micro-batches (Megatron and FSDP backends).

Every rank computes the same plan from the same broadcast batch, so each knows its own share and
every rank runs the same number of micro-batches: the forward/backward collectives stay in step.
"""

from __future__ import annotations

from collections.abc import Sequence

from areal_jobs.trainer.intake.packing import balanced_microbatches


def plan_microbatches(lengths: Sequence[int], dp_size: int, max_tokens: int) -> list[list[list[int]]]:
    """Sample indices per DP rank per micro-batch: DP shares balanced by tokens (largest first),
    each packed under `max_tokens`, with the same micro-batch count on every rank ([] = empty)."""
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    if lengths:
        by_share = balanced_microbatches(lengths, max(sum(lengths), 1), min_count=dp_size)
        for rank, share in enumerate(by_share):
            shares[rank] = share
    count = 1
    while True:
        plans = [
            balanced_microbatches([lengths[i] for i in share], max_tokens, min_count=count)
            for share in shares
        ]
        if max(len(p) for p in plans) <= count:
            break
        count = max(len(p) for p in plans)
    return [
        [[share[i] for i in mb] for mb in plan] + [[]] * (count - len(plan))
        for share, plan in zip(shares, plans, strict=True)
    ]
