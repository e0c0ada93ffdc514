"""What the bench sections share: the bench model, one real SGLang server, and an in-process
rollout rig (the real RolloutController, ServerPool, SGLangClient and weight-update handshake)
driven by a stand-in trainer that consumes groups and publishes weights.

`RolloutRig.publish` runs the handshake in the order ControllerService._update_weights does:
stop sending, pause the servers (per `rollout.pause_mode`), form the broadcast group once, let
the trainer side (a thread here, a process in a real run) broadcast every bucket while the
servers receive them, set the version, resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from areal_jobs.api import RewardResult, TensorSpec, WeightSender
from areal_jobs.config import AlgoConfig, DataConfig, ModelConfig, PauseMode, RolloutConfig
from areal_jobs.data.prompts import PromptStream
from areal_jobs.rollout.controller import RolloutController
from areal_jobs.rollout.server import ServerProcess, start_server
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.rollout.sglang_client import ServerCallError, SGLangClient
from areal_jobs.rollout.weight_update import WeightUpdateOrchestrator
from areal_jobs.transport import messages as m
from areal_jobs.transport.discovery import free_port

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
STEP_TIMEOUT_S = 300.0


def bench_model() -> Path:
    """The model `make run` trains: the committed warm start of the built-in tokenizer and tiny
    Qwen2, whose answers follow the task's long-tailed lengths (a random model's would not)."""
    from areal_jobs.tasks.warm_start.tiny_model import PACKAGED_DIR

    return PACKAGED_DIR


class InstantScorer:
    """Rewards off: every answer scores 0 at once (api.RewardScorer)."""

    async def score_group(self, requests):
        return [RewardResult(0.0) for _ in requests]

    def metrics(self) -> dict[str, float]:
        return {}


@contextlib.contextmanager
def sglang_server(
    model_dir: Path, threads: int, log_dir: Path, max_total_tokens: int = 65536
) -> Iterator[ServerProcess]:
    """A real SGLang server (CPU engine on this machine) with `threads` torch threads."""
    rollout = RolloutConfig(server_threads=threads, max_total_tokens=max_total_tokens)
    log = log_dir / f"sglang-{threads}t.log"
    server = start_server(
        str(model_dir), "127.0.0.1", free_port(), secrets.token_hex(8), rollout, ModelConfig(), log
    )
    try:
        try:
            server.wait_healthy(timeout_s=600)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}; last lines of {log}:\n{_tail(log)}") from None
        yield server
        if server.process.poll() is not None:
            raise RuntimeError(f"the SGLang server died during the bench; last lines of {log}:\n{_tail(log)}")
    finally:
        server.stop()


class SharedServer:
    """A server some sections share: started (and waited for) by the first `get`, stopped by
    `close` (idempotent: the last user may close it early to free the cores, the bench closes it
    after its last user in any case). `start` returns a started, not yet healthy, server."""

    def __init__(self, start: Callable[[], ServerProcess], log: Path) -> None:
        self._start, self._log = start, log
        self._server: ServerProcess | None = None

    def get(self) -> ServerProcess:
        if self._server is None:
            self._server = self._start()
            try:
                self._server.wait_healthy(timeout_s=600)
            except (RuntimeError, TimeoutError) as exc:
                self.close()
                raise RuntimeError(f"{exc}; last lines of {self._log}:\n{_tail(self._log)}") from None
        return self._server

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()


def run_on_server(body, quick: bool, server=None, prefix: str = "bench_"):
    """`asyncio.run(body(server, model_dir, quick))` on the given server (make bench shares one
    across sections), or on a fresh 2-thread server of the bench model started for this call."""
    model_dir = bench_model()
    if server is not None:
        return asyncio.run(body(server, model_dir, quick))
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp, sglang_server(model_dir, 2, Path(tmp)) as srv:
        return asyncio.run(body(srv, model_dir, quick))


def _tail(path: Path, lines: int = 25) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return (
        "\n".join(line for line in text if "Ignore import error" not in line)[-4000:] if text else "(no log)"
    )


def model_weights(model_dir: Path) -> dict:
    """HF-named tensors as the trainer would broadcast them (a tied lm_head is not stored)."""
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


class TimedClient:
    """Wraps a rollout client and records (start, end, tokens) of every /generate call, so the
    tokens generated inside a time window can be counted even for answers that take longer than
    the window (each call's tokens are spread evenly over its duration)."""

    def __init__(self, inner: SGLangClient, skip_flush: bool = False) -> None:
        self.inner = inner
        self.calls: list[tuple[float, float, int]] = []
        self.skip_flush = skip_flush
        self.flush_retries = 0
        self.flush_skipped = 0

    async def flush_cache(self) -> None:
        """Runtime issue (see bench/README.md): SGLang refuses /flush_cache while a request is still
        in its running batch, which the handshake's flush after every update hits always under
        pause_mode=in_place and sometimes right after an abort. The bench counts and works around
        it (skip for in_place, retry for 3 s otherwise) so that the modes can be compared at all."""
        if self.skip_flush:
            self.flush_skipped += 1
            return
        for _ in range(10):
            try:
                return await self.inner.flush_cache()
            except ServerCallError as exc:
                if exc.status != 400:
                    raise
                self.flush_retries += 1
                await asyncio.sleep(0.3)
        await self.inner.flush_cache()

    async def generate(self, request):
        t0 = time.monotonic()
        response = await self.inner.generate(request)
        self.calls.append((t0, time.monotonic(), len(response.output_ids)))
        return response

    def __getattr__(self, name: str):  # pause, resume, weight-update calls: straight through
        return getattr(self.inner, name)

    def tokens_between(self, t0: float, t1: float) -> float:
        total = 0.0
        for start, end, n in self.calls:
            overlap = min(end, t1) - max(start, t0)
            if overlap > 0:
                total += n * overlap / max(end - start, 1e-9)
        return total


class RolloutRig:
    """One real controller on one real server; groups land in `self.groups` (an asyncio.Queue)."""

    def __init__(
        self, server: ServerProcess, model_dir: Path, rollout: RolloutConfig, algo: AlgoConfig, scorer
    ) -> None:
        from areal_jobs.data.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(str(model_dir))
        self.client = SGLangClient(
            "0", server.url, server.api_key, generate_timeout_s=600, call_timeout_s=120
        )
        self.timed = TimedClient(self.client, skip_flush=rollout.pause_mode is PauseMode.in_place)
        self.pool = ServerPool()
        self.pool.add(0, self.timed)
        self.groups: asyncio.Queue[m.TrajectoryGroup] = asyncio.Queue()
        stream = PromptStream(DataConfig(seed=secrets.randbelow(1 << 20)), self.tokenizer.encode)
        self.ctl = RolloutController(
            rollout, algo, self.pool, scorer, stream, decode=self.tokenizer.decode, push=self.groups.put
        )
        self.orch = WeightUpdateOrchestrator(self.pool, rollout.pause_mode, STEP_TIMEOUT_S)
        port = free_port()
        from areal_jobs.weights.broadcast import WeightBroadcastGroup

        self.sender_group = WeightBroadcastGroup(f"bench-{port}", "127.0.0.1", port, "gloo", STEP_TIMEOUT_S)
        self._admission: asyncio.Task | None = None
        self.update_s: list[float] = []  # pause -> resume, per publish

    def start(self) -> None:
        self._admission = asyncio.create_task(self.ctl.admission_loop(), name="admission")

    def check(self) -> None:
        if self.ctl.fatal is not None:
            raise RuntimeError(f"rollout failed: {self.ctl.fatal!r}")

    async def take(self, count: int, timeout_s: float = 600.0) -> list[m.TrajectoryGroup]:
        out = []
        deadline = time.monotonic() + timeout_s
        while len(out) < count:
            self.check()
            try:
                out.append(
                    await asyncio.wait_for(self.groups.get(), timeout=min(5.0, deadline - time.monotonic()))
                )
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"only {len(out)}/{count} groups after {timeout_s:.0f}s") from None
        return out

    async def publish(self, version: int, weights: dict, trained: tuple[str, ...] = ()) -> None:
        """The weight-update handshake for `version`, with the trainer half in a thread."""
        from areal_jobs.weights.buckets import plan_buckets

        t0 = time.monotonic()
        specs = [
            TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in weights.items()
        ]
        buckets = tuple(plan_buckets(specs, 1 << 30))
        group = self.sender_group
        sender = WeightSender(group.base_name, group.master_address, group.master_port, buckets)
        ctl = self.ctl
        ctl.on_trained(trained)
        ctl.stop_sending()
        await self.orch.pause(lambda: self.pool.total_in_flight)
        init = self.orch.needs_group_init((sender,))
        generation = self.orch.next_generation() if init else self.orch.generation
        errors: list[BaseException] = []

        def trainer_side() -> None:
            try:
                if init:
                    group.init(self.pool.group_world_size(), generation)
                for b in buckets:
                    group.send_bucket(b, [weights[t.name] for t in b.tensors], f"bench bucket {b.index}")
            except BaseException as exc:  # noqa: BLE001 - re-raised below, in the event loop
                errors.append(exc)

        thread = threading.Thread(target=trainer_side, daemon=True)
        thread.start()
        if init:
            await self.orch.init_groups((sender,), "gloo")
        await self.orch.receive(version, (sender,))
        await asyncio.get_running_loop().run_in_executor(None, thread.join, STEP_TIMEOUT_S)
        if errors:
            raise errors[0]
        ctl.on_version(version)
        await self.orch.resume()
        ctl.resume_sending()
        self.update_s.append(time.monotonic() - t0)

    async def cut(self) -> float:
        """End a measurement window now: every in-flight request returns its partial answer
        (abort), so the window's tokens are all accounted for. Returns the window's end time."""
        t_end = time.monotonic()
        self.ctl.stop_sending()
        await self.client.abort_all()
        deadline = time.monotonic() + 60
        while self.ctl.segments_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return t_end

    async def close(self) -> None:
        """Stop generating and leave the server idle for the next rig: a request whose client went
        away keeps running in SGLang until it notices, which would slow the next measurement."""
        self.ctl.stop_sending()  # aborted samples must not be re-sent
        with contextlib.suppress(Exception):
            await self.client.abort_all()
        await self.ctl.stop()
        if self._admission is not None:
            self._admission.cancel()
            await asyncio.gather(self._admission, return_exceptions=True)
        await wait_idle(self.client)
        if self.sender_group.ready:
            with contextlib.suppress(Exception):
                await self.client.destroy_weights_update_group(self.orch.group_name(self._sender_stub()))
        self.sender_group.destroy()
        await self.client.close()

    def _sender_stub(self) -> WeightSender:
        g = self.sender_group
        return WeightSender(g.base_name, g.master_address, g.master_port, ())


async def wait_idle(client: SGLangClient, timeout_s: float = 120.0) -> None:
    """Until a one-token request comes back at once (the server has no other work left)."""
    from areal_jobs.api import GenerateRequest

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        await client.generate(
            GenerateRequest(f"bench-idle-{secrets.token_hex(4)}", [1, 2, 3], max_new_tokens=1)
        )
        if time.monotonic() - t0 < 0.25:
            return
        await asyncio.sleep(0.5)
    logger.warning("server still busy %.0fs after the rig closed", timeout_s)


@contextlib.contextmanager
def held_flock(lock: Path | None, yield_s: float = 0.0) -> Iterator[None]:
    """An exclusive flock(2) on `lock` for the duration (nothing when lock is None), so heavy jobs
    sharing one machine take turns; after releasing it, `yield_s` of sleep: flock is not fair, and
    a caller that locks again at once starves every other waiter."""
    if lock is None:
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
            time.sleep(yield_s)
