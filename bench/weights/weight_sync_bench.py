"""Weight sync: seconds and GB/s for the bench model through the real handshake to a real SGLang
server, and for a 1 GiB synthetic payload over gloo between two processes, against this
machine's memcpy bandwidth.

- tiny model: `RolloutRig.publish` with generation idle: pause, broadcast every bucket from the
  trainer side (a thread running WeightBroadcastGroup), SGLang receives and loads them, flush,
  resume. The first update also forms the group; the rest are timed (median).
- 1 GiB over gloo: WeightBroadcastGroup.send_bucket (the trainer's code: flatten + broadcast) to
  a second process that joins the group the way SGLang does (TCP rendezvous, prefixed store) and
  receives into a preallocated buffer. Loopback, so this is a CPU/memory-bound transport.
- memcpy: one copy of the same payload inside one process (torch, all threads), the ceiling for
  any transport that must touch every byte at least once.

Run: `python -m bench.weights.weight_sync_bench [--quick]`.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from areal_jobs.api import BucketSpec, TensorSpec
from areal_jobs.transport.discovery import free_port

GIB = 1 << 30


def _receiver(address: str, port: int, group_name: str, nbytes: int, repeats: int) -> None:
    """Rank 1 of a 2-rank group, joined as SGLang's init_weights_update_group does."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous

    timeout = timedelta(seconds=300)
    store, rank, size = next(rendezvous(f"tcp://{address}:{port}", 1, 2, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        size,
        rank,
        [],
        Backend("gloo"),
        PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(repeats):
        dist.broadcast(buffer, group=group, group_src=0)
    # no destroy_process_group: a group made by the helper is not registered for it (KeyError);
    # it goes with this process, as on an SGLang server that exits


def gloo_payload(nbytes: int, repeats: int) -> dict[str, float]:
    import torch

    from areal_jobs.weights.broadcast import WeightBroadcastGroup

    port = free_port()
    group = WeightBroadcastGroup(f"bench-payload-{port}", "127.0.0.1", port, "gloo", timeout_s=300)
    proc = mp.get_context("spawn").Process(
        target=_receiver, args=("127.0.0.1", port, f"{group.base_name}-0", nbytes, repeats), daemon=True
    )
    proc.start()
    try:
        group.init(2, 0)
        payload = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        bucket = BucketSpec(0, (TensorSpec("payload", "uint8", (nbytes,)),))
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            group.send_bucket(bucket, [payload], f"payload {i}")
            times.append(time.perf_counter() - t0)
    finally:
        group.destroy()
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
    best = min(times)
    return {
        "weight_sync/gloo_payload_gib": nbytes / GIB,
        "weight_sync/gloo_s": best,
        "weight_sync/gloo_gb_per_s": nbytes / best / 1e9,
    }


def memcpy(nbytes: int, repeats: int = 3) -> dict[str, float]:
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages is not bandwidth
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return {"weight_sync/memcpy_gb_per_s": nbytes / best / 1e9}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


async def tiny_model(server, model_dir: Path, updates: int) -> dict[str, float]:
    from areal_jobs.config import AlgoConfig, RolloutConfig
    from bench.harness import InstantScorer, RolloutRig, model_weights

    rig = RolloutRig(server, model_dir, RolloutConfig(), AlgoConfig(), InstantScorer())
    weights = model_weights(model_dir)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    try:
        for version in range(1, updates + 2):
            await rig.publish(version, weights)
    finally:
        await rig.close()
    steady = statistics.median(rig.update_s[1:])
    return {
        "weight_sync/tiny_mb": nbytes / 1e6,
        "weight_sync/tiny_first_s": rig.update_s[0],
        "weight_sync/tiny_s": steady,
        "weight_sync/tiny_gb_per_s": nbytes / steady / 1e9,
    }


def run(quick: bool = False, server=None) -> dict[str, float]:
    """Weight sync seconds and GB/s: tiny model to SGLang, 1 GiB over gloo, memcpy."""
    from bench.harness import bench_model, sglang_server

    nbytes = (64 << 20) if quick else GIB
    out = memcpy(nbytes)
    out.update(gloo_payload(nbytes, repeats=2 if quick else 3))
    model_dir = bench_model()
    updates = 3 if quick else 8
    if server is not None:
        out.update(asyncio.run(tiny_model(server, model_dir, updates)))
    else:
        with (
            tempfile.TemporaryDirectory(prefix="wsync_bench_") as tmp,
            sglang_server(model_dir, 2, Path(tmp)) as srv,
        ):
            out.update(asyncio.run(tiny_model(srv, model_dir, updates)))
    out["weight_sync/gloo_over_memcpy"] = (
        out["weight_sync/gloo_gb_per_s"] / out["weight_sync/memcpy_gb_per_s"]
    )
    return out


if __name__ == "__main__":
    for name, value in run(quick="--quick" in sys.argv[1:]).items():
        print(f"{name} {value:.4g}")
