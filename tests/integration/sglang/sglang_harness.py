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
from areal_jobs.transport.discovery import free_port
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
        port = free_port()
        self.group = WeightBroadcastGroup(f"test-{port}", "127.0.0.1", port, "gloo", timeout_s=120)
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
