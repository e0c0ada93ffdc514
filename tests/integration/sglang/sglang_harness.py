"""In-process drivers for the real weight-update handshake against a real SGLang server.

The controller half (WeightUpdateOrchestrator over a real SGLangClient) runs on an asyncio loop;
the trainer half (WeightBroadcastGroup) runs in a thread, exactly as the two processes would.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from areal_jobs.api import TensorSpec, WeightSender
from areal_jobs.config import PauseMode
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.rollout.sglang_client import SGLangClient
from areal_jobs.rollout.weight_update import WeightUpdateOrchestrator
from areal_jobs.weights.broadcast import WeightBroadcastGroup
from areal_jobs.weights.buckets import plan_buckets


def client_for(server) -> SGLangClient:
    return SGLangClient("0", server.url, server.api_key, generate_timeout_s=300, call_timeout_s=120)


class Broadcaster:
    """Owns one broadcast group to one server; `publish` runs the full handshake."""

    def __init__(self, server, bucket_bytes: int = 64 << 10, pause_mode: PauseMode = PauseMode.abort) -> None:
        self.pool = ServerPool()
        self.client = client_for(server)
        self.pool.add(0, self.client)
        self.orch = WeightUpdateOrchestrator(self.pool, pause_mode, step_timeout_s=120)
        # the store binds now on a port the kernel picks (as the trainer does): one picked free
        # earlier can be taken by another worker's server before the first update binds it
        self.group = WeightBroadcastGroup("test", "127.0.0.1", 0, "gloo", timeout_s=120)
        self.group.base_name = f"test-{self.group.listen()}"
        self.bucket_bytes = bucket_bytes

    async def publish(self, named: dict[str, torch.Tensor], version: int, on_paused=None) -> None:
        specs = [TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named.items()]
        buckets = tuple(plan_buckets(specs, self.bucket_bytes))
        sender = WeightSender(self.group.base_name, "127.0.0.1", self.group.master_port, buckets)
        await self.orch.pause(
            lambda: self.pool.total_in_flight
        )  # a controller on this pool counts its requests
        if on_paused is not None:
            await on_paused()
        errors: list[BaseException] = []

        def trainer_side(init: bool) -> None:
            try:
                if init:
                    self.group.init(self.pool.group_world_size(), generation)
                for b in buckets:
                    self.group.send_bucket(b, [named[t.name] for t in b.tensors], f"bucket {b.index}")
            except BaseException as exc:  # surfaced to the test below
                errors.append(exc)

        init = self.orch.needs_group_init((sender,))
        generation = self.orch.next_generation() if init else self.orch.generation
        thread = threading.Thread(target=trainer_side, args=(init,), daemon=True)
        thread.start()
        if init:
            await self.orch.init_groups((sender,), "gloo")
        await self.orch.receive(version, (sender,))
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 120)
        assert not thread.is_alive(), "trainer side of the broadcast did not finish"
        if errors:
            raise errors[0]
        await self.orch.resume()

    async def close(self) -> None:
        await self.client.close()
        self.group.destroy()


class NamedWeights:
    """A trainer backend's weight export over a dict of HF-named tensors (the trainer's masters)."""

    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        self.named = named

    def weight_specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in self.named.items()
        ]

    def iter_weights(self):
        yield from self.named.items()


class EncodedBroadcaster:
    """weight_sync.sync=delta through the real pieces: the trainer's StageSender (in a thread) and
    the controller's orchestrator over one server; `servers_version` as the controller computes it."""

    def __init__(self, server, named: dict[str, torch.Tensor], client=None, dtype=None,
                 bucket_bytes: int = 256 << 10, full_every: int = 1000) -> None:  # fmt: skip
        from areal_jobs.config import SyncMode, WeightSyncConfig
        from areal_jobs.weights.sender import StageSender

        self.pool = ServerPool()
        self.client = client or client_for(server)
        self.pool.add(0, self.client)
        self.orch = WeightUpdateOrchestrator(self.pool, PauseMode.abort, step_timeout_s=120)
        self.weights = NamedWeights(named)
        cfg = WeightSyncConfig(
            bucket_bytes=bucket_bytes, sync=SyncMode.delta, full_every=full_every, step_timeout_s=120
        )
        self.stage = StageSender.create(cfg, self.weights, stage=0, dtype=dtype)
        self.phases = []

    async def publish(self, version: int, servers_version: int | None = None) -> None:
        """One update of `version`; `servers_version` overrides what the controller would say."""
        from areal_jobs.transport import messages as m

        sender = self.stage.sender
        await self.orch.pause(lambda: self.pool.total_in_flight)
        init = self.orch.needs_group_init((sender,))
        generation = self.orch.next_generation() if init else self.orch.generation
        held = {s.held_version for s in self.pool.up_slots}
        if servers_version is None:
            servers_version = held.pop() if len(held) == 1 else -1
        paused = m.Paused(
            version, self.pool.group_world_size(), init, generation, servers_version=servers_version
        )
        errors: list[BaseException] = []

        def trainer_side() -> None:
            try:
                self.phases.append(self.stage.send(paused))
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        thread = threading.Thread(target=trainer_side, daemon=True)
        thread.start()
        if init:
            await self.orch.init_groups((sender,), "gloo")
        await self.orch.receive(version, (sender,))
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 120)
        assert not thread.is_alive(), "trainer side of the broadcast did not finish"
        if errors:
            raise errors[0]
        await self.orch.resume()

    async def close(self) -> None:
        await self.client.close()
        self.stage.close()
