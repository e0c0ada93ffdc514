"""This rank's part in every weight broadcast: the sender of its pipeline stage, or a bystander.

A stage's sender (the rank whose backend's `weight_specs()` is non-empty: the torch backend's one
process; Megatron's TP-0/DP-0 rank of each pipeline stage) hosts its own group's TCP store on its
own port, "areal-weights-s<stage>", and broadcasts its buckets over it; every other rank only joins
the collective export (the TP gathers). trainer/publisher.py drives it from rank 0's handshake.
"""

from __future__ import annotations

import os

from areal_jobs.api import TrainBackend, WeightSender
from areal_jobs.config import WeightSyncConfig
from areal_jobs.transport import messages as m
from areal_jobs.weights.broadcast import BroadcastTimeout, WeightBroadcastGroup
from areal_jobs.weights.buckets import plan_buckets


class StageSender:
    """This rank's part in every broadcast: a stage's sender sends its buckets over its own group;
    any other rank only joins the collective export (`iter_weights` yields nothing there)."""

    def __init__(
        self, backend: TrainBackend, sender: WeightSender | None, group: WeightBroadcastGroup | None
    ) -> None:
        self.backend = backend
        self.sender = sender
        self.group = group
        self.base_timeout_s = group.timeout_s if group is not None else 0.0  # weight_sync.step_timeout_s
        self._formed = False

    @classmethod
    def create(cls, cfg: WeightSyncConfig, backend: TrainBackend, stage: int) -> StageSender:
        """`stage`: this rank's pipeline stage. Ports: weight_sync.master_port + stage, else free."""
        specs = backend.weight_specs()
        if not specs:
            return cls(backend, None, None)
        host = os.environ.get("AREAL_BIND_HOST", "127.0.0.1")
        port = cfg.master_port + stage if cfg.master_port else 0  # 0: bound now, on a free port
        group = WeightBroadcastGroup(
            f"areal-weights-s{stage}", host, port, cfg.backend.value, cfg.step_timeout_s
        )
        port = group.listen()
        buckets = tuple(plan_buckets(specs, cfg.bucket_bytes))
        return cls(backend, WeightSender(group.base_name, host, port, buckets), group)

    def send(self, paused: m.Paused) -> float:
        """Join the broadcast of version `paused.version`; returns the bytes this rank sent."""
        if self.group is None or self.sender is None:
            for _ in self.backend.iter_weights():  # the TP gathers of this stage's export
                pass
            return 0.0
        # a repeat of an update that timed out gets longer stage timeouts (the controller's scale)
        self.group.timeout_s = self.base_timeout_s * paused.timeout_scale
        if paused.init_group:
            self.group.init(paused.world_size, paused.group_generation)
            self._formed = True
        elif not self.group.ready:
            raise RuntimeError("the controller reused a broadcast group this trainer never formed")
        weights = dict(self.backend.iter_weights())
        sent = 0.0
        buckets = self.sender.buckets
        try:
            for bucket in buckets:
                stage = (
                    f"weight broadcast bucket {bucket.index + 1}/{len(buckets)} of {self.sender.group_name} "
                    f"(version {paused.version})"
                )
                sent += self.group.send_bucket(bucket, [weights[t.name] for t in bucket.tensors], stage)
        except BroadcastTimeout:
            # a receiver died or hangs: dropping the group closes its connections, so the servers
            # still waiting in this broadcast fail at once instead of at their timeout
            self.group.destroy()
            raise
        return sent

    @property
    def dropped_group(self) -> bool:
        """This sender formed a group once and dropped it (a broadcast that broke off): the
        controller must form the groups again before the next broadcast (PauseRequest.regroup)."""
        return self.group is not None and self._formed and not self.group.ready

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
