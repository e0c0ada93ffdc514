"""This rank's part in every weight broadcast: the sender of its pipeline stage, or a bystander.

A stage's sender (the rank whose backend's `weight_specs()` is non-empty: the torch backend's one
process; Megatron's TP-0/DP-0 rank of each pipeline stage) hosts its own group's TCP store on its
own port, "areal-weights-s<stage>", and broadcasts its buckets over it; every other rank only joins
the collective export (the TP gathers). trainer/publish/publisher.py drives it from rank 0's handshake.

Every tensor is sent rounded to the servers' dtype (rollout.dtype; the backend keeps its own
masters). weight_sync.sync=full sends each bucket flat, loaded by the engine's own route;
weight_sync.sync=delta sends every bucket encoded (weights/staging.py): a delta against the copy
every server holds when the controller says they all hold it, a full copy otherwise and every
weight_sync.full_every versions. Each send returns its phases (weights/phases.py).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from areal_jobs.api import BucketSpec, TensorSpec, TrainBackend, WeightSender
from areal_jobs.config import DType, SyncMode, WeightSyncConfig
from areal_jobs.transport import messages as m
from areal_jobs.weights import delta as codec
from areal_jobs.weights.broadcast import BroadcastTimeout, WeightBroadcastGroup
from areal_jobs.weights.buckets import plan_buckets
from areal_jobs.weights.phases import UpdatePhases
from areal_jobs.weights.staging import SenderCopy, send_encoded_bucket

logger = logging.getLogger(__name__)

_FLOATS = {"float32", "bfloat16", "float16", "float64"}


def serving_specs(specs: list[TensorSpec], dtype: DType | None) -> list[TensorSpec]:
    """The specs as the servers receive them: floating tensors in the serving dtype."""
    if dtype is None:
        return list(specs)
    return [TensorSpec(s.name, dtype.value, s.shape) if s.dtype in _FLOATS else s for s in specs]


class StageSender:
    """This rank's part in every broadcast: a stage's sender sends its buckets over its own group;
    any other rank only joins the collective export (`iter_weights` yields nothing there)."""

    def __init__(
        self,
        backend: TrainBackend,
        sender: WeightSender | None,
        group: WeightBroadcastGroup | None,
        *,
        sync: SyncMode = SyncMode.full,
        full_every: int = 1,
    ) -> None:
        self.backend = backend
        self.sender = sender
        self.group = group
        self.sync = sync
        self.full_every = full_every
        self.copy = SenderCopy(pin=torch.cuda.is_available()) if sync is SyncMode.delta else None
        self.base_timeout_s = group.timeout_s if group is not None else 0.0  # weight_sync.step_timeout_s
        self._formed = False

    @classmethod
    def create(
        cls, cfg: WeightSyncConfig, backend: TrainBackend, stage: int, dtype: DType | None = None
    ) -> StageSender:
        """`stage`: this rank's pipeline stage. Ports: weight_sync.master_port + stage, else free.
        `dtype`: what the servers hold (config.serving_dtype); None = the backend's own."""
        specs = serving_specs(backend.weight_specs(), dtype)
        if not specs:
            return cls(backend, None, None)
        host = os.environ.get("AREAL_BIND_HOST", "127.0.0.1")
        port = cfg.master_port + stage if cfg.master_port else 0  # 0: bound now, on a free port
        group = WeightBroadcastGroup(
            f"areal-weights-s{stage}", host, port, cfg.backend.value, cfg.step_timeout_s
        )
        port = group.listen()
        buckets = tuple(plan_buckets(specs, cfg.bucket_bytes))
        encoded = cfg.sync is SyncMode.delta
        sender = WeightSender(group.base_name, host, port, buckets, encoded=encoded)
        return cls(backend, sender, group, sync=cfg.sync, full_every=cfg.full_every)

    def send(self, paused: m.Paused) -> UpdatePhases:
        """Join the broadcast of version `paused.version`; returns this rank's phases."""
        phases = UpdatePhases(encoded=self.copy is not None)
        if self.group is None or self.sender is None:
            for _ in self.backend.iter_weights():  # the TP gathers of this stage's export
                pass
            return phases
        # a repeat of an update that timed out gets longer stage timeouts (the controller's scale)
        self.group.timeout_s = self.base_timeout_s * paused.timeout_scale
        if paused.init_group:
            self.group.init(paused.world_size, paused.group_generation)
            self._formed = True
        elif not self.group.ready:
            raise RuntimeError("the controller reused a broadcast group this trainer never formed")
        t0 = time.perf_counter()
        weights = dict(self.backend.iter_weights())
        phases.gather_s = time.perf_counter() - t0
        buckets = self.sender.buckets
        try:
            for bucket in buckets:
                stage = (
                    f"weight broadcast bucket {bucket.index + 1}/{len(buckets)} of {self.sender.group_name} "
                    f"(version {paused.version})"
                )
                if self.copy is None:
                    self._send_flat(bucket, weights, stage, phases)
                else:
                    self._send_encoded(bucket, weights, paused, stage, phases)
        except BroadcastTimeout:
            # a receiver died or hangs: dropping the group closes its connections, so the servers
            # still waiting in this broadcast fail at once instead of at their timeout
            self.group.destroy()
            raise
        if self.copy is not None:
            self.copy.version = paused.version  # every bucket went out: the servers hold this now
        return phases

    def _send_flat(self, bucket: BucketSpec, weights: dict, stage: str, phases: UpdatePhases) -> None:
        t0 = time.perf_counter()
        parts = []
        for spec in bucket.tensors:
            tensor = weights[spec.name].detach().to(getattr(torch, spec.dtype))
            if tuple(tensor.shape) != spec.shape:
                raise ValueError(f"{stage}: tensor {spec.name} is {tuple(tensor.shape)}, spec says {spec}")
            parts.append(tensor.contiguous().reshape(-1).view(torch.uint8))
        flat = torch.cat(parts)
        t_staged = time.perf_counter()
        self.group.broadcast(flat, stage)
        phases.stage_s += t_staged - t0
        phases.add_bucket_send(time.perf_counter() - t_staged)
        phases.bytes_per_server += flat.numel()
        phases.full_bytes += flat.numel()

    def _send_encoded(
        self, bucket: BucketSpec, weights: dict, paused: m.Paused, stage: str, phases: UpdatePhases
    ) -> None:
        copy = self.copy
        assert copy is not None
        names = [t.name for t in bucket.tensors]
        if bucket.index == 0:
            # a delta only onto the version every server holds, and never at an anchor version
            phases.delta = (
                copy.version >= 0
                and paused.servers_version == copy.version
                and paused.version % self.full_every != 0
            )
            phases.base_version = copy.version
            copy.version = -1  # until every bucket of this update is out
        t0 = time.perf_counter()
        new = [copy.host(t.name, weights[t.name], getattr(torch, t.dtype)) for t in bucket.tensors]
        for spec, tensor in zip(bucket.tensors, new, strict=True):
            if tuple(tensor.shape) != spec.shape:
                raise ValueError(f"{stage}: tensor {spec.name} is {tuple(tensor.shape)}, spec says {spec}")
        have_base = all(n in copy.tensors for n in names)
        base = copy.base(names) if phases.delta else None
        if base is None and have_base:  # a full copy: measure what changed all the same (a metric)
            phases.changed += sum(
                int((codec.bits(b) != codec.bits(t)).sum()) for b, t in zip(copy.base(names), new)
            )
        phases.stage_s += time.perf_counter() - t0
        base_version = phases.base_version if phases.delta else -1
        send_encoded_bucket(self.group, bucket, new, base, base_version, paused.version, stage, phases)
        t_keep = time.perf_counter()
        copy.keep(names, new)
        phases.stage_s += time.perf_counter() - t_keep

    @property
    def dropped_group(self) -> bool:
        """This sender formed a group once and dropped it (a broadcast that broke off): the
        controller must form the groups again before the next broadcast (PauseRequest.regroup)."""
        return self.group is not None and self._formed and not self.group.ready

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
