"""The encoded update protocol end to end over real gloo groups: the trainer's StageSender (float32
masters, bf16 on the wire) and two receiver processes running weights/receiver.py exactly as the
servers' loaders do. Full copy, deltas, a receiver that missed a version (refused, answered with
the whole bucket, never applied), and the full_every anchor; every receiver's copy ends bitwise
equal to the sender's rounded weights."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import torch

from areal_jobs.api import TensorSpec
from areal_jobs.config import DType, SyncMode, WeightSyncConfig
from areal_jobs.transport import messages as m
from areal_jobs.weights import delta as codec
from areal_jobs.weights.sender import StageSender

NAMES = ("embed.weight", "layer.weight", "norm.weight")


def _receiver(rank: int, port: int, group_name: str, plan, jobs, results) -> None:
    """A server rank: joins like SGLang does, then receives every bucket of every update it is told."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous

    from areal_jobs.weights.receiver import BaseCopy, receive_bucket

    torch.set_num_threads(1)
    timeout = timedelta(seconds=120)
    store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", rank, 3, timeout=timeout))
    group, _ = _new_process_group_helper(
        3, rank, [], Backend("gloo"), PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    copy, loaded = BaseCopy(), []
    while (job := jobs.get(timeout=120)) is not None:
        if job == "forget":  # as if this server missed a version: its copy is one behind
            for name in copy.versions:
                copy.versions[name] -= 1
            continue
        for specs in plan:
            stats = receive_bucket(copy, group, specs, torch.device("cpu"), loaded.append, load_all=False)
            results.put((rank, "stats", stats["refused"], [n for batch in loaded for n, _ in batch]))
            loaded.clear()
    # bytes, not tensors: a tensor in a queue is shared memory that dies with this process
    results.put((rank, "copy", {n: codec.bits(t).numpy().tobytes() for n, t in copy.tensors.items()}, None))


class Weights:
    """A stand-in backend: float32 masters moved like small Adam steps (a few bf16 ulps cross)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.tensors = {
            "embed.weight": torch.randn(512, 64, generator=gen),
            "layer.weight": torch.randn(64, 64, generator=gen),
            "norm.weight": torch.ones(64),
        }
        self.gen = gen

    def step(self) -> None:
        for t in self.tensors.values():
            t.add_(torch.randn(t.shape, generator=self.gen) * 1e-4)

    def weight_specs(self):
        return [TensorSpec(n, "float32", tuple(t.shape)) for n, t in self.tensors.items()]

    def iter_weights(self):
        yield from self.tensors.items()


def test_full_then_deltas_then_a_refusal_then_an_anchor_leave_every_copy_exact():
    weights = Weights()
    cfg = WeightSyncConfig(bucket_bytes=40_000, sync=SyncMode.delta, full_every=4, step_timeout_s=120)
    sender = StageSender.create(cfg, weights, stage=0, dtype=DType.bfloat16)
    assert sender.sender.encoded and all(
        t.dtype == "bfloat16" for b in sender.sender.buckets for t in b.tensors
    )
    plan = [[(t.name, torch.bfloat16, t.shape) for t in b.tensors] for b in sender.sender.buckets]
    assert len(plan) == 2  # the embedding alone, then the rest
    ctx = mp.get_context("spawn")
    jobs = [ctx.Queue(), ctx.Queue()]
    results = ctx.Queue()
    group_name = f"{sender.group.base_name}-1"
    procs = [
        ctx.Process(
            target=_receiver, args=(r, sender.group.master_port, group_name, plan, jobs[r - 1], results)
        )
        for r in (1, 2)
    ]
    for p in procs:
        p.start()
    phases = {}
    try:
        held = -1
        for version in range(1, 6):
            weights.step()
            if version == 3:
                jobs[1].put("forget")  # rank 2 lost version 2; the controller does not know
            for q in jobs:
                q.put("update")
            paused = m.Paused(version, 3, init_group=version == 1, group_generation=1, servers_version=held)
            phases[version] = sender.send(paused)
            held = version
        for q in jobs:
            q.put(None)
        rows = [results.get(timeout=120) for _ in range(2 * 2 * 5 + 2)]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        sender.close()
    assert [phases[v].delta for v in range(1, 6)] == [False, True, True, False, True]  # 4: full_every
    assert [phases[v].refused_buckets for v in range(1, 6)] == [0, 0, 2, 0, 0]
    assert phases[2].bytes_per_server < phases[2].full_bytes / 5  # ~1 % of the bf16 values moved
    assert 0 < phases[2].changed < phases[2].elements
    refusals = [(r[0], r[2]) for r in rows if r[1] == "stats" and r[2]]
    assert refusals == [(2, 1.0), (2, 1.0)]  # both buckets of version 3, rank 2 only
    expected = {n: codec.bits(t.to(torch.bfloat16)).numpy().tobytes() for n, t in weights.tensors.items()}
    copies = {r[0]: r[2] for r in rows if r[1] == "copy"}
    for rank in (1, 2):
        assert set(copies[rank]) == set(NAMES)
        for name in NAMES:
            assert copies[rank][name] == expected[name], (rank, name)
