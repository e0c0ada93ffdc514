"""The controller's ceiling, with generation taken out of the picture.

1. Admission and completion: the real RolloutController (staleness admission, least-loaded
   dispatch, per-sample continuation logic, prompt encoding and answer decoding with the built-in
   tokenizer, group assembly) against zero-latency in-process servers that answer every
   /generate at once with 16 tokens. A stand-in trainer acknowledges every group. Requests/s is
   the rate of completed /generate calls; nothing but the controller's own work limits it.
2. Transport: the real ZeroMQ channels and codec (ControllerChannel PUSH -> TrainerChannel PULL on
   127.0.0.1, decoding and validating every message) with one group of G=8 answers of 256 tokens
   per message.

Run: `python -m bench.rollout.controller_bench [--quick]`.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import threading
import time

import numpy as np

from areal_jobs.api import FinishReason, GenerateRequest, GenerateResponse
from areal_jobs.config import AlgoConfig, DataConfig, RolloutConfig
from areal_jobs.data.prompts import PromptStream
from areal_jobs.rollout.controller import RolloutController
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.transport import codec
from areal_jobs.transport import messages as m
from areal_jobs.transport.channels import ControllerChannel, TrainerChannel
from areal_jobs.transport.discovery import free_ports
from bench.harness import InstantScorer

ANSWER_TOKENS = 16
NUM_SERVERS = 4


class ZeroLatencyServer:
    """api.RolloutBackendClient that answers at once: only the controller's cost remains."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        n = min(ANSWER_TOKENS, request.max_new_tokens)
        return GenerateResponse([7] * n, [-0.5] * n, FinishReason.stop, 0)

    async def pause(self, mode: str) -> None:
        return None

    async def resume(self) -> None:
        return None

    async def healthy(self) -> bool:
        return True

    async def abort_all(self) -> None:
        return None


async def controller_ceiling(duration_s: float) -> dict[str, float]:
    from areal_jobs.data.tokenizer import load_tokenizer
    from bench.harness import bench_model

    tok = load_tokenizer(str(bench_model()))
    pool = ServerPool()
    for i in range(NUM_SERVERS):
        pool.add(i, ZeroLatencyServer(str(i)))
    rollout = RolloutConfig(max_new_tokens=256, max_concurrent=256)
    algo = AlgoConfig(max_staleness=10**9, batch_size=8, group_size=8)
    ctl: RolloutController

    async def push(group: m.TrajectoryGroup) -> None:
        ctl.on_trained((group.group_id,))  # the stand-in trainer takes it at once

    ctl = RolloutController(
        rollout, algo, pool, InstantScorer(), PromptStream(DataConfig(), tok.encode), tok.decode, push
    )
    admission = asyncio.create_task(ctl.admission_loop())
    await asyncio.sleep(0.5)  # warm-up
    c0, g0, a0, t0 = ctl.counters.segments, ctl.counters.groups_pushed, ctl.stream.position, time.monotonic()
    await asyncio.sleep(duration_s)
    c1, g1, a1, t1 = ctl.counters.segments, ctl.counters.groups_pushed, ctl.stream.position, time.monotonic()
    await ctl.stop()
    admission.cancel()
    await asyncio.gather(admission, return_exceptions=True)
    if ctl.fatal is not None:
        raise RuntimeError(f"controller failed: {ctl.fatal!r}")
    dt = t1 - t0
    return {
        "controller/completed_requests_per_s": (c1 - c0) / dt,
        "controller/admitted_requests_per_s": (a1 - a0) * algo.group_size / dt,
        "controller/groups_per_s": (g1 - g0) / dt,
    }


def sample_group(
    rng: np.random.Generator, index: int, group_size: int = 8, tokens: int = 256
) -> m.TrajectoryGroup:
    samples = tuple(
        m.SampleTrajectory(
            sample_id=f"g{index}/{i}",
            output_ids=rng.integers(0, 384, tokens, dtype=np.int32),
            logprobs=-rng.random(tokens, dtype=np.float32),
            versions=np.full(tokens, 3, dtype=np.int32),
            reward=1.0,
            reward_status="ok",
            finish_reason="stop",
            num_interruptions=0,
        )
        for i in range(group_size)
    )
    return m.TrajectoryGroup(f"g{index}", index, rng.integers(0, 384, 40, dtype=np.int32), samples)


async def zmq_throughput(num_messages: int) -> dict[str, float]:
    token = secrets.token_hex(16)
    traj, ctrl = free_ports("127.0.0.1", 2)
    sender = ControllerChannel("127.0.0.1", traj, ctrl, token)
    sender.bind()
    receiver = TrainerChannel("127.0.0.1", traj, ctrl, token).connect()
    rng = np.random.default_rng(0)
    groups = [sample_group(rng, i) for i in range(64)]
    message_bytes = sum(len(f) for f in codec.encode_group(groups[0], token))
    received: list[float] = []

    def pull() -> None:
        deadline = time.monotonic() + 300
        while len(received) < num_messages and time.monotonic() < deadline:
            if isinstance(receiver.poll(1.0), m.TrajectoryGroup):
                received.append(time.monotonic())

    thread = threading.Thread(target=pull, daemon=True)
    thread.start()
    t0 = time.monotonic()
    for i in range(num_messages):
        await sender.push_group(groups[i % len(groups)])  # encoding included, as in the controller
    await asyncio.get_running_loop().run_in_executor(None, thread.join, 300)
    sender.close()
    receiver.close()
    if len(received) != num_messages:
        raise RuntimeError(f"ZeroMQ bench: {len(received)}/{num_messages} messages arrived")
    dt = received[-1] - t0
    return {
        "transport/messages_per_s": num_messages / dt,
        "transport/mb_per_s": num_messages * message_bytes / dt / 1e6,
        "transport/message_kb": message_bytes / 1e3,
    }


def run(quick: bool = False) -> dict[str, float]:
    """Controller requests/s against zero-latency servers; ZeroMQ trajectory messages/s and MB/s."""
    out = asyncio.run(controller_ceiling(3.0 if quick else 10.0))
    out.update(asyncio.run(zmq_throughput(500 if quick else 3000)))
    return out


if __name__ == "__main__":
    for name, value in run(quick="--quick" in sys.argv[1:]).items():
        print(f"{name} {value:.4g}")
