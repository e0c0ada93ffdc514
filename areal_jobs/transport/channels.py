"""ZeroMQ channels between the rollout controller and trainer rank 0.

    controller (binds)                          trainer rank 0 (connects)
    PUSH  tcp://host:P      -- TrajectoryGroup -->  PULL
    ROUTER tcp://host:P+1  <-- control (both ways) -->  DEALER

The controller binds because it lives at a known place (the first trainer node); trainers come
and go (restarts) and simply reconnect. Every frame goes through `codec`; a message that fails
to decode (bad schema, wrong token, malformed) is dropped, logged and counted, never applied.
"""

from __future__ import annotations

import logging
import uuid

import zmq
import zmq.asyncio

from areal_jobs.transport import codec
from areal_jobs.transport import messages as m

logger = logging.getLogger(__name__)

_LINGER_MS = 1000


class ControllerChannel:
    """Asyncio side (the controller's event loop)."""

    def __init__(self, host: str, traj_port: int, ctrl_port: int, token: str) -> None:
        self.host, self.traj_port, self.ctrl_port, self.token = host, traj_port, ctrl_port, token
        self.rejected = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._push: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._peer: bytes | None = None  # identity of the trainer that spoke last

    def bind(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, _LINGER_MS)
        self._push.bind(f"tcp://{self.host}:{self.traj_port}")
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, _LINGER_MS)
        # a restarted trainer reuses nothing: route replies to whoever spoke last
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.bind(f"tcp://{self.host}:{self.ctrl_port}")
        logger.info(
            "controller channel bound on %s:%d (trajectories) and :%d (control)",
            self.host,
            self.traj_port,
            self.ctrl_port,
        )

    @property
    def has_peer(self) -> bool:
        return self._peer is not None

    async def push_group(self, group: m.TrajectoryGroup) -> None:
        assert self._push is not None, "bind() first"
        await self._push.send_multipart(codec.encode_group(group, self.token))

    async def recv_control(self, timeout_s: float | None = None) -> m.ControlMessage | None:
        """Next valid control message, or None after `timeout_s` (None = wait forever)."""
        assert self._router is not None, "bind() first"
        timeout_ms = None if timeout_s is None else int(timeout_s * 1000)
        while True:
            if not await self._router.poll(timeout_ms):
                return None
            frames = await self._router.recv_multipart()
            if len(frames) != 2:
                self._reject(f"control message with {len(frames) - 1} frames")
                continue
            try:
                msg = codec.decode_control(frames[1], self.token)
            except codec.MessageError as exc:
                self._reject(str(exc))
                continue
            self._peer = frames[0]
            return msg

    async def send_control(self, msg: m.ControlMessage) -> None:
        assert self._router is not None, "bind() first"
        if self._peer is None:
            raise RuntimeError(f"no trainer connected to send {type(msg).__name__} to")
        await self._router.send_multipart([self._peer, codec.encode_control(msg, self.token)])

    def _reject(self, why: str) -> None:
        self.rejected += 1
        logger.warning("rejected control message: %s", why)

    def close(self) -> None:
        for sock in (self._push, self._router):
            if sock is not None:
                sock.close()
        if self._ctx is not None:
            self._ctx.term()


class TrainerChannel:
    """Blocking side (trainer rank 0). `poll` returns whichever arrives first."""

    def __init__(self, controller_host: str, traj_port: int, ctrl_port: int, token: str) -> None:
        self.controller_host, self.traj_port, self.ctrl_port, self.token = (
            controller_host,
            traj_port,
            ctrl_port,
            token,
        )
        self.rejected = 0
        self._ctx = zmq.Context()
        self._pull: zmq.Socket | None = None
        self._dealer: zmq.Socket | None = None
        self._poller = zmq.Poller()

    def connect(self) -> TrainerChannel:
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.connect(f"tcp://{self.controller_host}:{self.traj_port}")
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, _LINGER_MS)
        self._dealer.setsockopt(zmq.IDENTITY, f"trainer-{uuid.uuid4().hex[:8]}".encode())
        self._dealer.connect(f"tcp://{self.controller_host}:{self.ctrl_port}")
        self._poller.register(self._pull, zmq.POLLIN)
        self._poller.register(self._dealer, zmq.POLLIN)
        return self

    def send(self, msg: m.ControlMessage) -> None:
        assert self._dealer is not None, "connect() first"
        self._dealer.send(codec.encode_control(msg, self.token))

    def poll(self, timeout_s: float) -> m.TrajectoryGroup | m.ControlMessage | None:
        """The next valid group or control message (control first), or None after timeout_s."""
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        if self._dealer in ready:
            frame = self._dealer.recv()
            try:
                return codec.decode_control(frame, self.token)
            except codec.MessageError as exc:
                self._reject(str(exc))
                return self.poll(0)
        if self._pull in ready:
            frames = self._pull.recv_multipart()
            try:
                return codec.decode_group(frames, self.token)
            except codec.MessageError as exc:
                self._reject(str(exc))
                return self.poll(0)
        return None

    def _reject(self, why: str) -> None:
        self.rejected += 1
        logger.warning("rejected message from controller: %s", why)

    def close(self) -> None:
        for sock in (self._pull, self._dealer):
            if sock is not None:
                sock.close()
        self._ctx.term()
