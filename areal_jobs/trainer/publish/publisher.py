"""The trainer's half of the weight-update handshake, with one sender per pipeline stage.

    rank 0:        PauseRequest(v, senders) ─▶ wait Paused ─▶ announce Publish(paused) ─┐
    every rank:    sender: [form its group] ─▶ broadcast its buckets; others: join the export ◀┘
    rank 0:        wait VersionPublished  (or UpdateRetry: a server died mid-update; ask again)

Each rank's part in the broadcast is its `StageSender` (weights/sender.py: one sender per pipeline
stage). `gather_senders` collects every sender's address and bucket plan on start-up, so rank 0's PauseRequest names them all. Fallback (weight_sync.method=disk): write
an HF safetensors checkpoint (collectively) and let every server `/update_weights_from_disk` it.
Every wait is bounded by weight_sync.step_timeout_s and names its stage when it fires.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from areal_jobs.api import BucketSpec, TensorSpec, TrainBackend, WeightSender
from areal_jobs.config import WeightSync, WeightSyncConfig
from areal_jobs.trainer.dist.ranks import Publish, RankChannel
from areal_jobs.trainer.intake.inbox import Inbox
from areal_jobs.transport import messages as m
from areal_jobs.weights.broadcast import BroadcastTimeout, resolve_backend
from areal_jobs.weights.buckets import bucket_bytes
from areal_jobs.weights.phases import UpdatePhases
from areal_jobs.weights.sender import StageSender

# model.lora.ship=adapter: versions whose PEFT directory stays on disk. A vLLM server re-reads an
# adapter its LRU cache evicted while a request still uses it (pause_mode=in_place)
ADAPTER_DIRS_KEPT = 16


def adapter_bytes(path: str) -> int:
    """What one adapter update carries to each server: the PEFT weights file."""
    return (Path(path) / "adapter_model.safetensors").stat().st_size


logger = logging.getLogger(__name__)

# more UpdateRetry for one version than the protocol allows is an error, not a fault to ride out
MAX_UPDATE_RETRIES = m.MAX_UPDATE_RETRIES


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
        adapter_dir: Path | None = None,
        update_deadline_s: float = 0.0,
    ) -> None:
        self.cfg = cfg
        # how long one update may take, its repeats included (control.update_deadline_s); the
        # waits end sooner when the controller falls silent (the inbox's silence bound)
        self.update_deadline_s = max(update_deadline_s, cfg.step_timeout_s)
        self.inbox = inbox
        self.channel = channel
        self.local = local
        self.senders = senders
        self.backend_name = resolve_backend(cfg.backend.value)
        self.disk_dir = disk_dir
        self.adapter_dir = adapter_dir  # model.lora.ship=adapter: each version's PEFT directory

    def publish(self, version: int, backend: TrainBackend, trained: tuple[str, ...]) -> dict[str, float]:
        """`backend` only writes the disk fallback (rank 0's LeaderBackend: collective)."""
        t0 = time.monotonic()
        disk_path = adapter_path = ""
        if self.adapter_dir is not None:  # the adapters alone, written once, loaded by every server
            adapter_path = str(self.adapter_dir / f"v{version}")
            backend.save_adapter(adapter_path)
        elif self.cfg.method is WeightSync.disk:
            disk_path = str(self.disk_dir / f"v{version}")
            backend.save_hf(disk_path)
        retries = slow_retries = 0
        while True:
            self.inbox.send(
                m.PauseRequest(
                    version,
                    self.senders,
                    self.backend_name,
                    trained,
                    disk_path=disk_path,
                    adapter_path=adapter_path,
                    regroup=self.local.dropped_group,
                )  # fmt: skip
            )
            paused = self.inbox.wait_for(
                m.Paused, self.update_deadline_s, f"pausing generation for version {version}"
            )
            t_paused = time.monotonic()
            sent_bytes = 0.0
            phases = UpdatePhases()
            if adapter_path:
                sent_bytes = float(adapter_bytes(adapter_path))
            elif not disk_path and paused.world_size > 1:  # world 1: no server is up to receive anything
                self.channel.send(Publish(paused))
                encoded = any(s.encoded for s in self.senders)
                try:
                    phases = self.local.send(paused)
                    if encoded:  # the controller ends an encoded update only on this word
                        self.inbox.send(m.BroadcastDone(version, True))
                    # every stage's buckets (rank 0 only knows its own phases: stage 0's)
                    sent_bytes = float(sum(bucket_bytes(b) for s in self.senders for b in s.buckets))
                    if len(self.senders) == 1:
                        sent_bytes = phases.bytes_per_server
                except BroadcastTimeout as exc:
                    # a server died (or hangs) mid-broadcast; the group is dropped, which releases
                    # the other servers. The controller decides: UpdateRetry, or UpdateFailed (raised)
                    logger.warning("broadcast of version %d broke off: %s", version, exc)
                    if encoded:
                        self.inbox.send(m.BroadcastDone(version, False, str(exc)[:500]))
            t_sent = time.monotonic()
            reply = self.inbox.wait_for(
                (m.VersionPublished, m.UpdateRetry),
                self.update_deadline_s,
                f"servers loading version {version}",
            )
            if isinstance(reply, m.VersionPublished):
                published = reply
                break
            retries += 1
            slow = not reply.lost_servers  # a stage timed out with every server alive
            slow_retries += slow
            if slow_retries > m.MAX_SLOW_UPDATE_RETRIES or retries - slow_retries > MAX_UPDATE_RETRIES:
                raise RuntimeError(
                    f"the update to version {version} was retried {retries - 1} times; giving up"
                )
            if slow:
                logger.warning(
                    "the update to version %d timed out at %s with every server alive: sending it "
                    "again with longer stage timeouts", version, reply.stage,
                )  # fmt: skip
            else:
                logger.warning(
                    "servers %s died during the update to version %d (%s): sending it again to the others",
                    list(reply.lost_servers), version, reply.stage,
                )  # fmt: skip
        if disk_path:
            self._prune_disk(self.disk_dir, keep=version)
        if adapter_path:  # the servers hold it now (a vLLM server may re-read an evicted one)
            self._prune_disk(self.adapter_dir, keep=version, keep_last=ADAPTER_DIRS_KEPT)
        t_end = time.monotonic()
        return {
            **phases.metrics(),
            # the controller's view: the pause generation sees (pause -> resume), its parts
            "weights/gen_pause_s": published.update_s,
            "weights/stop_s": published.pause_s,
            "weights/receive_s": published.receive_s,
            "weights/resume_s": published.resume_s,
            "weights/server_calls_s": published.bucket_calls_s,  # bucket round trips (receive + load)
            "weights/total_s": t_end - t0,
            "weights/bytes_per_server": sent_bytes,  # every stage's buckets, or the adapters
            "weight_sync/total_s": t_end - t0,
            "weight_sync/pause_s": t_paused - t0,
            "weight_sync/broadcast_s": t_sent - t_paused,
            "weight_sync/controller_s": published.update_s,
            "weight_sync/bytes": sent_bytes,
            "weight_sync/num_buckets": float(sum(len(s.buckets) for s in self.senders)),
            "weight_sync/num_senders": float(len(self.senders)),
            "weight_sync/retries": float(retries),  # servers lost inside this update
            # the admission bound eta in force at the controller (algo.max_staleness=auto moves it)
            **(
                {"staleness/bound": float(published.staleness_bound)}
                if published.staleness_bound >= 0
                else {}
            ),
        }

    @staticmethod
    def _prune_disk(folder: Path, keep: int, keep_last: int = 1) -> None:
        for old in folder.glob("v*"):
            if not (old.name[1:].isdigit() and keep - keep_last < int(old.name[1:]) <= keep):
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        self.local.close()


def _sender_json(sender: WeightSender) -> dict:
    return {
        "group_name": sender.group_name,
        "master_address": sender.master_address,
        "master_port": sender.master_port,
        "buckets": [[[t.name, t.dtype, list(t.shape)] for t in b.tensors] for b in sender.buckets],
        "encoded": sender.encoded,
    }


def _sender_from_json(row: dict) -> WeightSender:
    buckets = tuple(
        BucketSpec(i, tuple(TensorSpec(name, dtype, tuple(shape)) for name, dtype, shape in tensors))
        for i, tensors in enumerate(row["buckets"])
    )
    return WeightSender(
        row["group_name"], row["master_address"], int(row["master_port"]), buckets, bool(row.get("encoded"))
    )
