"""The sender's side of a weight-broadcast group: trainer rank (rank 0) -> every server rank.

SGLang joins with `/init_weights_update_group` (ranks rank_offset..) and receives each bucket with
`/update_weights_from_distributed` (load_format "flattened_bucket": one uint8 broadcast per bucket,
the tensors' bytes back to back). We form the group the same way SGLang does (TCP rendezvous
hosted by rank 0, a store prefixed by the group name), so both sides agree on every store key.
NCCL on GPUs, gloo on CPU: nothing below depends on which.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from areal_jobs.api import BucketSpec

logger = logging.getLogger(__name__)


class BroadcastTimeout(RuntimeError):
    """A broadcast stage exceeded its timeout; the message names the stage."""


def gpu_available() -> bool:
    """True when this process can use an NVIDIA GPU; AREAL_JOBS_FORCE_CPU=1 says no (the rollout
    servers then run their CPU path, and rollout.dtype=auto resolves to model.dtype everywhere)."""
    if os.environ.get("AREAL_JOBS_FORCE_CPU") == "1":
        return False
    return torch.cuda.is_available()


def resolve_backend(name: str) -> str:
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return name


class WeightBroadcastGroup:
    """One sender's process group. Construct, then `init(world_size, name)`, then `send_bucket`s.

    The controller names every (re)formation "<base_name>-<generation>": torch cannot register a
    group name twice in one process, and servers keep old groups until told to destroy them.
    """

    def __init__(self, base_name: str, master_address: str, master_port: int, backend: str, timeout_s: float):
        self.base_name = base_name
        self.group_name = ""
        self.master_address = master_address
        self.master_port = master_port
        self.backend = resolve_backend(backend)
        self.timeout_s = timeout_s
        self._group: dist.ProcessGroup | None = None
        self.world_size = 0
        # One store server for the process's lifetime: re-creating it on the same port while the
        # old one is torn down lets a joining server connect to the dying one. Each formation
        # uses its own key prefix (the generation-named group), as SGLang does on its side.
        self._store: dist.TCPStore | None = None

    def listen(self) -> int:
        """Bind the rendezvous store now and return its port (idempotent). Port 0: the kernel
        picks a free one at bind time. A port picked earlier and bound only at the first update
        could meanwhile be taken by another process of the job (seen: the controller's control
        socket took it, and the first update failed with EADDRINUSE)."""
        if self._store is None:
            self._store = dist.TCPStore(
                self.master_address,
                self.master_port,
                None,
                True,
                timedelta(seconds=self.timeout_s),
                wait_for_workers=False,
                multi_tenant=True,
            )
            self.master_port = self._store.port
        return self.master_port

    @property
    def ready(self) -> bool:
        return self._group is not None

    def init(self, world_size: int, generation: int) -> None:
        """Host the rendezvous and wait until every server rank joined (bounded by timeout_s)."""
        from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

        self.destroy()
        self.group_name = f"{self.base_name}-{generation}"
        timeout = timedelta(seconds=self.timeout_s)
        t0 = time.monotonic()
        try:
            self.listen()
            self._store.set_timeout(timeout)
            store = PrefixStore(self.group_name, self._store)
            self._group, _ = _new_process_group_helper(
                world_size, 0, [], Backend(self.backend), store, group_name=self.group_name, timeout=timeout
            )
            size = world_size
            # as SGLang does on its side: register the ranks so the group can be destroyed cleanly
            _world.pg_group_ranks[self._group] = {i: i for i in range(size)}
        except (RuntimeError, dist.DistBackendError) as exc:
            raise BroadcastTimeout(
                f"forming weight broadcast group {self.group_name!r} ({world_size} ranks at "
                f"{self.master_address}:{self.master_port}) failed after {time.monotonic() - t0:.1f}s: {exc}"
            ) from exc
        self.world_size = world_size
        logger.info("broadcast group %s ready: %d ranks, %s", self.group_name, world_size, self.backend)

    def send_bucket(self, bucket: BucketSpec, tensors: Iterable[torch.Tensor], stage: str) -> float:
        """Broadcast one bucket as a single flat uint8 tensor; returns the bytes sent."""
        if self._group is None:
            raise RuntimeError("init() the broadcast group before sending")
        parts = []
        for spec, tensor in zip(bucket.tensors, tensors, strict=True):
            if tuple(tensor.shape) != spec.shape or str(tensor.dtype).removeprefix("torch.") != spec.dtype:
                raise ValueError(
                    f"{stage}: tensor {spec.name} is {tuple(tensor.shape)} {tensor.dtype}, spec says {spec}"
                )
            parts.append(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        flat = torch.cat(parts)
        self.broadcast(flat, stage)
        return float(flat.numel())

    def broadcast(self, tensor: torch.Tensor, stage: str) -> None:
        """Rank 0 (this sender) -> every server rank, bounded by timeout_s (the group is dropped
        by the caller on failure: see StageSender.send)."""
        if self._group is None:
            raise RuntimeError("init() the broadcast group before sending")
        if self.backend == "nccl":
            tensor = tensor.cuda()
        # group_src: the sender is rank 0 of this group whatever its rank in the trainer's own world
        self._wait(dist.broadcast(tensor, group=self._group, group_src=0, async_op=True), stage)

    def all_gather(self, row: torch.Tensor, stage: str) -> list[torch.Tensor]:
        """One row from every rank of the group (the receivers' status after an encoded bucket)."""
        if self._group is None:
            raise RuntimeError("init() the broadcast group before sending")
        if self.backend == "nccl":
            row = row.cuda()
        rows = [torch.empty_like(row) for _ in range(self.world_size)]
        self._wait(dist.all_gather(rows, row, group=self._group, async_op=True), stage)
        return [r.cpu() for r in rows]

    def _wait(self, work, stage: str) -> None:
        failure = None
        try:
            if not work.wait(timeout=timedelta(seconds=self.timeout_s)):
                failure = f"{stage}: not acknowledged within {self.timeout_s:.0f}s"
        except (RuntimeError, dist.DistBackendError) as exc:
            failure = f"{stage} failed: {exc}"
        if failure is not None:
            # no reference to the failed work may outlive this frame (the exception's traceback
            # would keep it): while one does, destroy() leaves the group's connections open and
            # the other receivers wait in the broadcast until their own timeout (measured: gloo)
            del work
            raise BroadcastTimeout(failure)

    def destroy(self) -> None:
        if self._group is not None:
            try:
                dist.destroy_process_group(self._group)
            except (RuntimeError, ValueError) as exc:  # a dead peer must not block a re-init
                logger.warning("destroying broadcast group %s: %s", self.group_name, exc)
            self._group = None
