"""Real ZeroMQ sockets on 127.0.0.1: trajectories and control both ways; messages without the job's
token, or malformed, are refused and counted, and the channel keeps working."""

from __future__ import annotations

import asyncio

import numpy as np
import zmq

from areal_jobs.transport import codec
from areal_jobs.transport import messages as m
from areal_jobs.transport.channels import ControllerChannel, TrainerChannel
from areal_jobs.transport.discovery import free_ports

TOKEN = "the-job-token"


def group(i: int) -> m.TrajectoryGroup:
    s = m.SampleTrajectory(f"g{i}/0", np.arange(5, dtype=np.int32), -np.ones(5, dtype=np.float32),
                           np.zeros(5, dtype=np.int32), 1.0, "ok", "stop", 0)  # fmt: skip
    return m.TrajectoryGroup(f"g{i}", i, np.array([1, 2], dtype=np.int32), (s,))


def test_round_trip_and_refusals():
    traj, ctrl = free_ports("127.0.0.1", 2)

    async def go():
        server = ControllerChannel("127.0.0.1", traj, ctrl, TOKEN)
        server.bind()
        trainer = TrainerChannel("127.0.0.1", traj, ctrl, TOKEN).connect()
        intruder_ctx = zmq.Context()
        intruder = intruder_ctx.socket(zmq.DEALER)
        intruder.connect(f"tcp://127.0.0.1:{ctrl}")
        try:
            intruder.send(codec.encode_control(m.Stop(reason="evil"), "wrong-token"))
            intruder.send(b"not even json")
            trainer.send(m.TrainerHello(version=0, step=0))
            msg = await server.recv_control(timeout_s=10)
            assert msg == m.TrainerHello(version=0, step=0)
            # The intruder's connection is fair-queued with the trainer's, so its two messages may
            # arrive after the hello: keep reading (bounded) until both were refused.
            for _ in range(100):
                if server.rejected >= 2:
                    break
                assert await server.recv_control(timeout_s=0.05) is None  # nothing valid to read
            assert server.rejected == 2
            for i in range(3):
                await server.push_group(group(i))
            await server.send_control(m.ControllerHello(version=0, num_servers=1))
            received = []
            for _ in range(200):
                got = await asyncio.get_running_loop().run_in_executor(None, trainer.poll, 0.05)
                if got is not None:
                    received.append(got)
                if len(received) == 4:
                    break
            kinds = [type(r).__name__ for r in received]
            assert kinds.count("TrajectoryGroup") == 3 and "ControllerHello" in kinds
            assert [g.group_id for g in received if isinstance(g, m.TrajectoryGroup)] == ["g0", "g1", "g2"]
        finally:
            intruder.close(0)
            intruder_ctx.term()
            trainer.close()
            server.close()

    asyncio.run(go())


def test_trainer_side_refuses_a_forged_controller():
    traj, ctrl = free_ports("127.0.0.1", 2)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.bind(f"tcp://127.0.0.1:{traj}")
    trainer = TrainerChannel("127.0.0.1", traj, ctrl, TOKEN).connect()
    try:
        push.send_multipart(codec.encode_group(group(0), "forged"))
        push.send_multipart(codec.encode_group(group(1), TOKEN))
        got = None
        for _ in range(100):
            got = trainer.poll(0.05)
            if got is not None:
                break
        assert isinstance(got, m.TrajectoryGroup) and got.group_id == "g1"
        assert trainer.rejected == 1
    finally:
        push.close(0)
        trainer.close()
        ctx.term()
