"""A weight broadcast whose peer disappears fails within its timeout, names the stage, and does
not hang. Real gloo groups formed exactly as with SGLang; the peer is a real second process."""

from __future__ import annotations

import multiprocessing as mp
import time
from datetime import timedelta

import pytest
import torch

from areal_jobs.api import BucketSpec, TensorSpec
from areal_jobs.transport.discovery import free_port
from areal_jobs.weights.broadcast import BroadcastTimeout, WeightBroadcastGroup

GROUP = "fault-test"


def _peer(port: int, behaviour: str, joining, ready) -> None:
    """Joins as rank 1 like an SGLang server would, receives bucket 1, then dies or hangs."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous

    torch.set_num_threads(1)
    joining.set()  # imports done (seconds on a loaded machine): the 5 s group timeout starts after
    timeout = timedelta(seconds=60)
    store, rank, size = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
    group, _ = _new_process_group_helper(
        2, 1, [], Backend("gloo"), PrefixStore(f"{GROUP}-1", store), group_name=f"{GROUP}-1", timeout=timeout
    )
    buf = torch.empty(64, dtype=torch.uint8)
    dist.broadcast(buf, group=group, group_src=0)
    ready.set()
    if behaviour == "die":
        import os

        os._exit(0)
    time.sleep(120)  # "hang": alive but never receives the next bucket


@pytest.mark.parametrize("behaviour", ["die", "hang"])
def test_broadcast_to_a_vanished_peer_fails_in_time_and_names_the_stage(behaviour):
    port = free_port()
    ctx = mp.get_context("spawn")
    joining, ready = ctx.Event(), ctx.Event()
    peer = ctx.Process(target=_peer, args=(port, behaviour, joining, ready), daemon=True)
    peer.start()
    try:
        assert joining.wait(120), "the peer process did not start"
        group = WeightBroadcastGroup(GROUP, "127.0.0.1", port, "gloo", timeout_s=5.0)
        group.init(world_size=2, generation=1)
        spec = BucketSpec(0, (TensorSpec("w", "float32", (16,)),))
        group.send_bucket(spec, [torch.zeros(16)], "weight broadcast bucket 1/2 (version 1)")
        assert ready.wait(30)
        if behaviour == "die":
            peer.join(30)
        t0 = time.monotonic()
        with pytest.raises(BroadcastTimeout, match=r"weight broadcast bucket 2/2 \(version 1\)"):
            big = BucketSpec(1, (TensorSpec("w2", "float32", (1 << 20,)),))
            group.send_bucket(big, [torch.ones(1 << 20)], "weight broadcast bucket 2/2 (version 1)")
        elapsed = time.monotonic() - t0
        assert elapsed < 5.0 + 15.0, f"took {elapsed:.1f}s with a 5s timeout"
        group.destroy()
    finally:
        peer.kill()
        peer.join(10)


def test_group_formation_without_peers_times_out_with_the_group_named():
    group = WeightBroadcastGroup("lonely", "127.0.0.1", free_port(), "gloo", timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(BroadcastTimeout, match="forming weight broadcast group 'lonely-1'"):
        group.init(world_size=2, generation=1)
    assert time.monotonic() - t0 < 2.0 + 15.0
