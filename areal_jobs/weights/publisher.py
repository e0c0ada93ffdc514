"""The trainer's half of the weight-update handshake, with one sender per pipeline stage.

    rank 0:        PauseRequest(v, senders) ─▶ wait Paused ─▶ announce Publish(paused) ─┐
    every rank:    sender: [form its group] ─▶ broadcast its buckets; others: join the export ◀┘
    rank 0:        wait VersionPublished

A stage's sender (the rank whose backend's `weight_specs()` is non-empty: the torch backend's one
process; Megatron's TP-0/DP-0 rank of each pipeline stage) hosts its own group's TCP store on its
own port, "areal-weights-s<stage>". `gather_senders` collects every sender's address and bucket
plan on start-up, so rank 0's PauseRequest names them all. Fallback (weight_sync.method=disk): write
an HF safetensors checkpoint (collectively) and let every server `/update_weights_from_disk` it.
Every wait is bounded by weight_sync.step_timeout_s and names its stage when it fires.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from areal_jobs.api import BucketSpec, TensorSpec, TrainBackend, WeightSender
from areal_jobs.config import WeightSync, WeightSyncConfig
from areal_jobs.rollout.discovery import free_port
from areal_jobs.trainer.inbox import Inbox
from areal_jobs.trainer.ranks import Publish, RankChannel
from areal_jobs.transport import messages as m
from areal_jobs.weights.broadcast import WeightBroadcastGroup, resolve_backend
from areal_jobs.weights.buckets import bucket_bytes, plan_buckets

logger = logging.getLogger(__name__)


class StageSender:
    """This rank's part in every broadcast: a stage's sender sends its buckets over its own group;
    any other rank only joins the collective export (`iter_weights` yields nothing there)."""

    def __init__(
        self, backend: TrainBackend, sender: WeightSender | None, group: WeightBroadcastGroup | None
    ) -> None:
        self.backend = backend
        self.sender = sender
        self.group = group

    @classmethod
    def create(cls, cfg: WeightSyncConfig, backend: TrainBackend, stage: int) -> StageSender:
        """`stage`: this rank's pipeline stage. Ports: weight_sync.master_port + stage, else free."""
        specs = backend.weight_specs()
        if not specs:
            return cls(backend, None, None)
        host = os.environ.get("AREAL_BIND_HOST", "127.0.0.1")
        port = cfg.master_port + stage if cfg.master_port else free_port(host)
        group = WeightBroadcastGroup(
            f"areal-weights-s{stage}", host, port, cfg.backend.value, cfg.step_timeout_s
        )
        buckets = tuple(plan_buckets(specs, cfg.bucket_bytes))
        return cls(backend, WeightSender(group.base_name, host, port, buckets), group)

    def send(self, paused: m.Paused) -> float:
        """Join the broadcast of version `paused.version`; returns the bytes this rank sent."""
        if self.group is None or self.sender is None:
            for _ in self.backend.iter_weights():  # the TP gathers of this stage's export
                pass
            return 0.0
        if paused.init_group:
            self.group.init(paused.world_size, paused.group_generation)
        elif not self.group.ready:
            raise RuntimeError("the controller reused a broadcast group this trainer never formed")
        weights = dict(self.backend.iter_weights())
        sent = 0.0
        buckets = self.sender.buckets
        for bucket in buckets:
            stage = (
                f"weight broadcast bucket {bucket.index + 1}/{len(buckets)} of {self.sender.group_name} "
                f"(version {paused.version})"
            )
            sent += self.group.send_bucket(bucket, [weights[t.name] for t in bucket.tensors], stage)
        return sent

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()


def gather_senders(channel: RankChannel, local: StageSender) -> tuple[WeightSender, ...]:
    """Every stage's sender in stage order (= global rank order). Collective: every rank calls it."""
    rows = channel.all_gather_json(_sender_json(local.sender) if local.sender else None)
    senders = tuple(_sender_from_json(row) for row in rows if row is not None)
    if rows[0] is None:
        raise RuntimeError("trainer rank 0 exports no weights: it must be pipeline stage 0's sender")
    return senders


class WeightPublisher:
    """Rank 0's side: the controller handshake, and the Publish announcement to the other ranks."""

    def __init__(
        self,
        cfg: WeightSyncConfig,
        inbox: Inbox,
        channel: RankChannel,
        local: StageSender,
        senders: tuple[WeightSender, ...],
        disk_dir: Path,
    ) -> None:
        self.cfg = cfg
        self.inbox = inbox
        self.channel = channel
        self.local = local
        self.senders = senders
        self.backend_name = resolve_backend(cfg.backend.value)
        self.disk_dir = disk_dir

    def publish(self, version: int, backend: TrainBackend, trained: tuple[str, ...]) -> dict[str, float]:
        """`backend` only writes the disk fallback (rank 0's LeaderBackend: collective)."""
        t0 = time.monotonic()
        disk_path = ""
        if self.cfg.method is WeightSync.disk:
            disk_path = str(self.disk_dir / f"v{version}")
            backend.save_hf(disk_path)
        self.inbox.channel.send(
            m.PauseRequest(version, self.senders, self.backend_name, trained, disk_path=disk_path)
        )
        paused = self.inbox.wait_for(
            m.Paused, self.cfg.step_timeout_s, f"pausing generation for version {version}"
        )
        t_paused = time.monotonic()
        sent_bytes = 0.0
        if not disk_path and paused.world_size > 1:  # world 1: no server is up to receive anything
            self.channel.send(Publish(paused))
            self.local.send(paused)
            sent_bytes = float(sum(bucket_bytes(b) for s in self.senders for b in s.buckets))
        t_sent = time.monotonic()
        published = self.inbox.wait_for(
            m.VersionPublished, self.cfg.step_timeout_s, f"servers loading version {version}"
        )
        if disk_path:
            self._prune_disk(keep=version)
        t_end = time.monotonic()
        return {
            "weight_sync/total_s": t_end - t0,
            "weight_sync/pause_s": t_paused - t0,
            "weight_sync/broadcast_s": t_sent - t_paused,
            "weight_sync/controller_s": published.update_s,
            "weight_sync/bytes": sent_bytes,
            "weight_sync/num_buckets": float(sum(len(s.buckets) for s in self.senders)),
            "weight_sync/num_senders": float(len(self.senders)),
        }

    def _prune_disk(self, keep: int) -> None:
        for old in self.disk_dir.glob("v*"):
            if old.name != f"v{keep}":
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        self.local.close()


def _sender_json(sender: WeightSender) -> dict:
    return {
        "group_name": sender.group_name,
        "master_address": sender.master_address,
        "master_port": sender.master_port,
        "buckets": [[[t.name, t.dtype, list(t.shape)] for t in b.tensors] for b in sender.buckets],
    }


def _sender_from_json(row: dict) -> WeightSender:
    buckets = tuple(
        BucketSpec(i, tuple(TensorSpec(name, dtype, tuple(shape)) for name, dtype, shape in tensors))
        for i, tensors in enumerate(row["buckets"])
    )
    return WeightSender(row["group_name"], row["master_address"], int(row["master_port"]), buckets)
