"""Rank 0 drives the other trainer ranks with small typed commands (Megatron: one process per GPU).

    rank 0    Train ─▶ Publish(paused) ─▶ Train ─▶ Publish ─▶ SaveCheckpoint(path) ─▶ … SaveHF ─▶ Stop
    rank > 0  follow(): receive the next command, make the same collective call, until Stop

Only rank 0 talks to the controller and runs the TrainLoop. Every backend call that may be
collective (train_step, the weight export, checkpoints, save_hf) runs on every rank, in the order
rank 0 announces it: `LeaderBackend` announces each call before making it on rank 0. Commands
are JSON over a gloo group of the trainer's own world; every broadcast has a timeout. A follower
that hears nothing for `command_timeout_s`, or hears Abort, exits non-zero; rank 0 announces
Abort before it fails. With one rank nothing is sent and every call stays local.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from areal_jobs.api import TensorSpec, TrainBackend
from areal_jobs.config import JobConfig
from areal_jobs.trainer.dist import gpu_memory
from areal_jobs.transport import messages as m
from areal_jobs.weights.broadcast import BroadcastTimeout

if TYPE_CHECKING:
    from areal_jobs.trainer.intake.batch import TrainBatch
    from areal_jobs.weights.sender import StageSender

logger = logging.getLogger(__name__)

# Followers are at most one collective behind rank 0 when it sends (the tail of a call rank 0
# already left), so rank 0 waits this long for them to take a command; Abort waits less.
ACK_TIMEOUT_S = 600.0
ABORT_TIMEOUT_S = 30.0

# ------------------------------------------------------------------------------ commands


@dataclass(frozen=True, slots=True)
class Train:
    """train_step: rank 0 passes the batch, the others None (the backend scatters it)."""


@dataclass(frozen=True, slots=True)
class Publish:
    """The controller paused generation: senders (re)form their groups and send their buckets."""

    paused: m.Paused


@dataclass(frozen=True, slots=True)
class SaveCheckpoint:
    path: str


@dataclass(frozen=True, slots=True)
class LoadCheckpoint:
    path: str


@dataclass(frozen=True, slots=True)
class SaveHF:
    path: str


@dataclass(frozen=True, slots=True)
class SaveAdapter:
    """LoRA: the adapters alone as a PEFT directory (model.lora.ship=adapter, final_hf=adapter)."""

    path: str


@dataclass(frozen=True, slots=True)
class Stop:
    """The run is over (finished or preempted and checkpointed): exit 0."""


@dataclass(frozen=True, slots=True)
class Abort:
    """Rank 0 failed: exit non-zero."""

    reason: str


Command = Train | Publish | SaveCheckpoint | LoadCheckpoint | SaveHF | SaveAdapter | Stop | Abort
_KINDS: dict[str, type] = {
    cls.__name__: cls
    for cls in (Train, Publish, SaveCheckpoint, LoadCheckpoint, SaveHF, SaveAdapter, Stop, Abort)
}


def encode(cmd: Command) -> bytes:
    return json.dumps({"kind": type(cmd).__name__, "body": dataclasses.asdict(cmd)}).encode()


def decode(payload: bytes) -> Command:
    raw = json.loads(payload)
    body = raw["body"]
    if raw["kind"] == "Publish":
        return Publish(m.Paused(**body["paused"]))
    return _KINDS[raw["kind"]](**body)


class RankAborted(RuntimeError):
    """Rank 0 announced a failure, or went silent: this rank must exit non-zero."""


def command_timeout_s(cfg: JobConfig) -> float:
    """How long a follower waits for the next command. Longer than any stretch in which a healthy
    rank 0 sends none, so it fires only when rank 0 is stuck: start-up (controller discovery,
    hello, the first batch), a weight update on a slow machine (its two waits on the controller,
    each up to control.update_deadline_s) or the final evaluation, whichever can be longer."""
    step_s = cfg.weight_sync.step_timeout_s
    start_s = max(cfg.rollout.server_start_timeout_s, cfg.control.server_start_deadline_s)
    startup_s = start_s + 600 + 5 * step_s + cfg.trainer.batch_wait_timeout_s
    final_s = cfg.rollout.request_timeout_s + 600 + step_s
    update_s = 2 * cfg.control.update_deadline_s
    return max(startup_s, final_s, update_s) + 600


# ------------------------------------------------------------------------------ channel


class RankChannel:
    """Rank 0 -> every other trainer rank, over a gloo group of the trainer's world."""

    def __init__(self, group: Any, rank: int, world_size: int, command_timeout_s: float) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.command_timeout_s = command_timeout_s
        self.broken = False  # a broadcast failed: the group is unusable (a peer died or hung)

    @classmethod
    def single(cls) -> RankChannel:
        """One trainer process (the torch backend, or Megatron at TP = PP = DP = 1)."""
        return cls(None, 0, 1, 0.0)

    @classmethod
    def join(cls, command_timeout_s: float) -> RankChannel:
        """Collective over the default process group (already initialised): every rank calls it."""
        world = dist.get_world_size()
        if world == 1:
            return cls.single()
        timeout = timedelta(seconds=max(command_timeout_s, ACK_TIMEOUT_S))
        rank = dist.get_rank()
        try:
            group = dist.new_group(backend="gloo", timeout=timeout)
        except (RuntimeError, dist.DistBackendError) as exc:
            # new_group ends with rank 0 writing the group's sequence number to the TCP store that
            # rank 0 hosts, and the others reading it: rank 0 returns at once, so when it dies right
            # after joining, a slower follower's read gets "Connection reset by peer" from the store
            raise RankAborted(f"rank {rank} joining rank 0's command group: {exc}") from exc
        return cls(group, rank, world, command_timeout_s)

    def send(self, cmd: Command, timeout_s: float = ACK_TIMEOUT_S) -> None:
        """Rank 0: announce `cmd` to every other rank (returns once all have it)."""
        assert self.rank == 0, "only rank 0 sends commands"
        if self.world_size > 1:
            self._broadcast(encode(cmd), timeout_s, f"rank 0 announcing {type(cmd).__name__}")

    def receive(self) -> Command:
        """Ranks > 0: the next command (RankAborted when none comes within command_timeout_s)."""
        what = f"rank {self.rank} waiting for rank 0's next command"
        return decode(self._broadcast(None, self.command_timeout_s, what))

    def abort(self, reason: str) -> None:
        """Rank 0 is failing: tell the others, bounded and best effort (they may be gone)."""
        if self.world_size == 1 or self.broken:
            return
        try:
            self.send(Abort(reason[:2000]), ABORT_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a follower stuck or dead; the launcher ends it
            logger.warning("could not announce the failure to the other ranks: %s", exc)

    def all_gather_json(self, value: Any, timeout_s: float = ACK_TIMEOUT_S) -> list[Any]:
        """Every rank's JSON-able `value`, in rank order (collective)."""
        if self.world_size == 1:
            return [value]
        payload = json.dumps(value).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        mine = torch.tensor([len(payload)], dtype=torch.int64)
        self._wait(
            dist.all_gather(sizes, mine, group=self.group, async_op=True), timeout_s, "gathering sizes"
        )
        longest = max(int(s) for s in sizes)
        bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        local = torch.zeros(longest, dtype=torch.uint8)
        local[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._wait(dist.all_gather(bufs, local, group=self.group, async_op=True), timeout_s, "gathering")
        return [json.loads(bytes(b[: int(n)].numpy())) for b, n in zip(bufs, sizes, strict=True)]

    def _broadcast(self, payload: bytes | None, timeout_s: float, what: str) -> bytes:
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        self._wait(dist.broadcast(size, group=self.group, group_src=0, async_op=True), timeout_s, what)
        if payload is not None:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buf = torch.empty(int(size), dtype=torch.uint8)
        self._wait(dist.broadcast(buf, group=self.group, group_src=0, async_op=True), timeout_s, what)
        return bytes(buf.numpy())

    def _wait(self, work: Any, timeout_s: float, what: str) -> None:
        try:
            done = work.wait(timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, dist.DistBackendError) as exc:
            self.broken = True
            raise RankAborted(f"{what}: {exc}") from exc
        if done is False:
            self.broken = True
            raise RankAborted(f"{what}: nothing within {timeout_s:.0f}s")


# ------------------------------------------------------------------------------ both sides


class LeaderBackend:
    """Rank 0's backend: announces every collective call to the other ranks, then makes it.

    `weight_specs`/`iter_weights` stay local: the publisher announces a broadcast (Publish) and
    each rank's `StageSender` runs the export.
    """

    def __init__(self, backend: TrainBackend, channel: RankChannel) -> None:
        self.backend = backend
        self.channel = channel

    def train_step(self, batch: TrainBatch | None) -> dict[str, float]:
        self.channel.send(Train())
        metrics = self.backend.train_step(batch)
        gpu_memory.after_step()
        return metrics

    def weight_specs(self) -> list[TensorSpec]:
        return self.backend.weight_specs()

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.backend.iter_weights()

    def save_checkpoint(self, path: str) -> None:
        self.channel.send(SaveCheckpoint(path))
        self.backend.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.channel.send(LoadCheckpoint(path))
        self.backend.load_checkpoint(path)

    def save_hf(self, path: str) -> None:
        self.channel.send(SaveHF(path))
        self.backend.save_hf(path)

    def save_adapter(self, path: str) -> None:
        self.channel.send(SaveAdapter(path))
        self.backend.save_adapter(path)


def follow(
    channel: RankChannel, backend: TrainBackend, stage: StageSender, signalled: threading.Event
) -> None:
    """Ranks > 0: make the calls rank 0 announces until Stop. Abort or silence raises RankAborted.

    SIGUSR1/SIGTERM (srun forwards them to every task) set `signalled`, but they are rank 0's to
    act on: it checkpoints collectively, then sends Stop. Here they are only noted.
    """
    while True:
        cmd = channel.receive()
        if signalled.is_set():
            logger.info("rank %d was signalled: rank 0 decides (checkpoint, then Stop)", channel.rank)
            signalled.clear()
        match cmd:
            case Train():
                backend.train_step(None)
                gpu_memory.after_step()
            case Publish(paused):
                try:
                    stage.send(paused)
                except BroadcastTimeout as exc:  # rank 0 hears from the controller: retry or fail
                    logger.warning("rank %d: broadcast broke off: %s", channel.rank, exc)
            case SaveCheckpoint(path):
                backend.save_checkpoint(path)
            case LoadCheckpoint(path):
                backend.load_checkpoint(path)
            case SaveHF(path):
                backend.save_hf(path)
            case SaveAdapter(path):
                backend.save_adapter(path)
            case Stop():
                stage.close()
                return
            case Abort(reason):
                raise RankAborted(f"rank 0 failed: {reason}")


def exit_now(code: int) -> None:
    """Leave at once with `code` when several ranks run: a collective left pending by a failure
    would otherwise block the interpreter's exit until its timeout."""
    if "torch.distributed" in sys.modules and dist.is_initialized() and dist.get_world_size() > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
