"""The trainer's half of the weight-update handshake (single sender: the torch backend).

    PauseRequest(v, buckets) ─▶ wait Paused ─▶ [form group] ─▶ broadcast buckets ─▶ wait VersionPublished

Fallback (weight_sync.method=disk): write an HF safetensors checkpoint and let every server
`/update_weights_from_disk` it. Every wait is bounded by weight_sync.step_timeout_s and names
its stage when it fires.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from areal_jobs.api import TrainBackend, WeightSender
from areal_jobs.config import WeightSync, WeightSyncConfig
from areal_jobs.trainer.inbox import Inbox
from areal_jobs.transport import messages as m
from areal_jobs.weights.broadcast import WeightBroadcastGroup, resolve_backend
from areal_jobs.weights.buckets import plan_buckets

logger = logging.getLogger(__name__)


class WeightPublisher:
    def __init__(
        self, cfg: WeightSyncConfig, inbox: Inbox, master_address: str, master_port: int, disk_dir: Path
    ):
        self.cfg = cfg
        self.inbox = inbox
        self.backend_name = resolve_backend(cfg.backend.value)
        self.group = WeightBroadcastGroup(
            "areal-weights-s0", master_address, master_port, cfg.backend.value, cfg.step_timeout_s
        )
        self.disk_dir = disk_dir

    def publish(self, version: int, backend: TrainBackend, trained: tuple[str, ...]) -> dict[str, float]:
        t0 = time.monotonic()
        specs = backend.weight_specs()
        buckets = tuple(plan_buckets(specs, self.cfg.bucket_bytes))
        sender = WeightSender(
            self.group.base_name, self.group.master_address, self.group.master_port, buckets
        )
        disk_path = ""
        if self.cfg.method is WeightSync.disk:
            disk_path = str(self.disk_dir / f"v{version}")
            backend.save_hf(disk_path)
        self.inbox.channel.send(
            m.PauseRequest(version, (sender,), self.backend_name, trained, disk_path=disk_path)
        )
        paused = self.inbox.wait_for(
            m.Paused, self.cfg.step_timeout_s, f"pausing generation for version {version}"
        )
        t_paused = time.monotonic()
        sent_bytes = 0.0
        if not disk_path and paused.world_size > 1:  # world 1: no server is up to receive anything
            if paused.init_group:
                self.group.init(paused.world_size, paused.group_generation)
            elif not self.group.ready:
                raise RuntimeError("the controller reused a broadcast group this trainer never formed")
            weights = dict(backend.iter_weights())
            for bucket in buckets:
                stage = f"weight broadcast bucket {bucket.index + 1}/{len(buckets)} (version {version})"
                sent_bytes += self.group.send_bucket(bucket, [weights[t.name] for t in bucket.tensors], stage)
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
            "weight_sync/num_buckets": float(len(buckets)),
        }

    def _prune_disk(self, keep: int) -> None:
        for old in self.disk_dir.glob("v*"):
            if old.name != f"v{keep}":
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        self.group.destroy()
