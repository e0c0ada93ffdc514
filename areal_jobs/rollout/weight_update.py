"""The controller's half of the weight-update handshake, one named, timed stage at a time.

    trainer: PauseRequest(v) ─▶ pause servers ─▶ Paused ─▶ [init groups] ─▶ buckets ─▶ resume
                                                              ▲ trainer broadcasts the same buckets

Each stage runs under `step_timeout_s`; when one fails or times out, `StageError` names it
("weight broadcast bucket 3/7 of sender s0 to server 2"). A server that fails while pausing or
resuming (before or after the broadcast group is formed) is only marked down: the update goes on
with the others, and the server rejoins later. A server that dies while the groups form or the
buckets travel leaves the pool too, and the update is sent again to the others (`find_lost`;
service.py sends UpdateRetry). Any other failure: the controller reports UpdateFailed to the
trainer and exits non-zero so the scheduler can restart the job. Never a silent hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from areal_jobs.api import WeightSender
from areal_jobs.config import PauseMode
from areal_jobs.rollout.engine_http import ServerCallError
from areal_jobs.rollout.server_pool import ServerPool, ServerSlot

logger = logging.getLogger(__name__)

_ABORT_BUDGET_S = 5.0  # abort-mode pause: how long we abort and wait before SGLang's pause takes over
_ABORT_RECHECK_S = 0.25  # ... and how long before aborting again (a request that arrived late)
_FLUSH_ATTEMPTS = 40  # flush_cache refused while the scheduler still holds its last batch: retry
_FLUSH_RETRY_S = 0.05
_HEALTH_PROBE_S = 10.0  # after a failed stage: a server that cannot say its weight version in this is lost


# what a stage failure says when it is slowness, not a wrong request: the stage's own timeout, a
# call that went unanswered or was dropped, or the trainer's broadcast that broke off at its timeout
# (the servers' half of the collective then sees the connection closed)
_SLOW_MARKERS = (
    "timed out",
    "no answer",
    "attempts over",
    "connection closed",
    "connection reset",
    "timeout",
)


class StageError(RuntimeError):
    def __init__(self, stage: str, detail: str) -> None:
        super().__init__(f"{stage}: {detail}")
        self.stage = stage
        self.detail = detail

    @property
    def slow(self) -> bool:
        """The stage failed by taking too long (worth sending the update again with longer
        timeouts), not because a server refused the request (HTTP 400: wrong shape), which
        repeating cannot fix."""
        return any(marker in self.detail.lower() for marker in _SLOW_MARKERS)


async def run_stage(stage: str, awaitable: Awaitable, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(awaitable, timeout=timeout_s)
    except TimeoutError:
        raise StageError(stage, f"timed out after {timeout_s:.0f}s") from None
    except StageError:
        raise
    except Exception as exc:  # any failure inside a stage is reported with the stage's name
        raise StageError(stage, f"{type(exc).__name__}: {exc}") from exc


class WeightUpdateOrchestrator:
    """Pauses, updates and resumes every up server of `pool` for one new policy version."""

    def __init__(
        self, pool: ServerPool, pause_mode: PauseMode, step_timeout_s: float, call_deadline_s: float = 0.0
    ) -> None:
        self.pool = pool
        self.pause_mode = pause_mode
        self.step_timeout_s = step_timeout_s
        # how long a repeatable stage call may keep repeating (control.call_deadline_s; the clients
        # repeat it): at least one step timeout
        self.call_deadline_s = max(call_deadline_s, step_timeout_s)
        # an update sent again after a stage timed out with every server alive (service.py) gets
        # stage timeouts this many times longer: 1, 2, 4, ...
        self.timeout_scale = 1.0
        self._group_key: tuple | None = None  # (server indices, sender groups) the groups were built for
        # a re-formed group gets a fresh name: torch refuses to register a name twice in a process
        self.generation = 0
        self._live_groups: list[str] = []
        self.bucket_calls_s = 0.0  # the last receive: the slowest server's bucket calls, summed

    async def pause(self, in_flight: Callable[[], int]) -> None:
        """`in_flight` counts the controller's requests on the servers; it sends no new ones now."""
        if self.pause_mode is PauseMode.drain:
            await run_stage("drain in-flight requests", _wait_zero(in_flight), self.step_timeout_s)
            return
        mode = self.pause_mode
        if mode is PauseMode.abort:
            await self._abort_until_idle(in_flight)
            if in_flight() == 0:
                # Every request we sent has come back and we send none until resume(): there is
                # nothing to pause. SGLang's abort pause would sleep a whole second when a finished
                # request has not yet released the server's update lock (1 update in 3 on the
                # built-in task), and an in-place pause freezes the scheduler before it marks
                # itself idle, after which it refuses flush_cache.
                return
        await self._each_server("pause generation", lambda s: s.client.pause(mode.value), tolerate=True)

    def needs_group_init(self, senders: tuple[WeightSender, ...]) -> bool:
        return self._group_key != self._key(senders)

    def _key(self, senders: tuple[WeightSender, ...]) -> tuple:
        servers = tuple(s.index for s in self.pool.up_slots)
        return servers, tuple((s.group_name, s.master_address, s.master_port) for s in senders)

    def forget_groups(self) -> None:
        """Servers changed (one died or came back): groups must be re-formed on the next update."""
        self._group_key = None

    def group_name(self, sender: WeightSender) -> str:
        return f"{sender.group_name}-{self.generation}"

    async def init_groups(self, senders: tuple[WeightSender, ...], backend: str) -> None:
        """Form one group per sender with every up server (the generation was bumped by `next_generation`)."""
        for old in self._live_groups:  # best effort: a dead server's groups die with it
            for slot in self.pool.up_slots:
                try:
                    await asyncio.wait_for(slot.client.destroy_weights_update_group(old), self.step_timeout_s)
                except Exception as exc:  # noqa: BLE001 - stale groups only cost memory
                    logger.warning("could not destroy old group %s on server %d: %s", old, slot.index, exc)
        offsets = self.pool.rank_offsets()
        world = self.pool.group_world_size()
        for sender in senders:
            name = self.group_name(sender)
            await self._each_server(
                f"forming broadcast group {name}",
                lambda s, snd=sender, nm=name: s.client.init_weights_update_group(
                    snd.master_address, snd.master_port, offsets[s.index], world, nm, backend,
                    timeout_s=self.stage_timeout_s,
                ),
            )  # fmt: skip
        self._live_groups = [self.group_name(s) for s in senders]
        self._group_key = self._key(senders)

    @property
    def stage_timeout_s(self) -> float:
        """The first attempt of a stage, and how long a server may lag behind the others."""
        return self.step_timeout_s * self.timeout_scale

    def next_generation(self) -> int:
        self.generation += 1
        return self.generation

    async def receive(self, version: int, senders: tuple[WeightSender, ...]) -> None:
        """Every server receives every bucket, in the same global order (no cross-sender deadlock)."""
        for slot in self.pool.up_slots:  # mixed until every bucket arrived (weights/staging.py)
            slot.held_version = -1
        try:
            await self._receive_buckets(version, senders)
        except StageError:
            # close the sessions the live servers opened: SGLang refuses a second begin while one
            # is open, and a retry sends every bucket again (best effort: the dead cannot answer)
            await asyncio.gather(
                *(
                    asyncio.wait_for(s.client.end_weight_update(), self.step_timeout_s)
                    for s in self.pool.up_slots
                ),
                return_exceptions=True,
            )
            raise
        # every bucket has arrived: a server that dies from here on (seen: kill -9 during vLLM's
        # end-of-update RPC) only leaves the pool, to be restarted and rejoin with current weights
        await self._each_server("end weight update", lambda s: s.client.end_weight_update(), tolerate=True)
        for slot in self.pool.up_slots:
            slot.held_version = version
        if self.pause_mode is not PauseMode.in_place:
            # in_place keeps the paused requests' KV cache by design, and SGLang refuses to flush
            # while they are held (HTTP 400): cached prefixes from the old weights stay usable
            await self._each_server("flush cache", _flush_when_idle, tolerate=True)

    async def _receive_buckets(self, version: int, senders: tuple[WeightSender, ...]) -> None:
        await self._each_server("begin weight update", lambda s: s.client.begin_weight_update())
        calls_s: dict[int, float] = {}

        async def pipeline(slot: ServerSlot) -> None:
            for sender in senders:
                total = len(sender.buckets)
                # an encoded bucket (weight_sync.sync=delta) goes to our receiver in the server
                receive = (
                    slot.client.receive_encoded_bucket
                    if sender.encoded
                    else slot.client.update_weights_from_distributed
                )
                for bucket in sender.buckets:
                    stage = f"weight broadcast bucket {bucket.index + 1}/{total} of sender {sender.group_name} to server {slot.index}"
                    t0 = time.monotonic()
                    await run_stage(
                        stage,
                        receive(
                            bucket.tensors, self.group_name(sender), version, timeout_s=self.stage_timeout_s
                        ),
                        self.stage_timeout_s,
                    )
                    calls_s[slot.index] = calls_s.get(slot.index, 0.0) + time.monotonic() - t0

        # every pipeline ends before a failure is raised: when a server dies mid-broadcast, the
        # others' calls return (with an error) once the trainer drops the group, and only then is
        # it safe to re-form the groups without the dead one (service.py retries the update)
        results = await asyncio.gather(*(pipeline(s) for s in self.pool.up_slots), return_exceptions=True)
        self.bucket_calls_s = max(calls_s.values(), default=0.0)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]

    async def find_lost(self, members: list[int], timeout_s: float = _HEALTH_PROBE_S) -> list[int]:
        """Which of the update's `members` left the pool (the health loop may have marked one down
        meanwhile) or no longer answer: the dead, after a failed stage. A live server whose stage
        failed is not lost (the failure is then the update's own).

        Alive means its HTTP front answers a metadata call (its weight version). Not /health: on
        SGLang that generates a token, which waits while the server is paused (measured: a live,
        paused survivor timed out and was dropped with the dead one)."""

        async def probe(index: int) -> bool:
            slot = self.pool.slots.get(index)
            if slot is None or not slot.up:
                return False
            try:
                await asyncio.wait_for(slot.client.weight_version(), timeout_s)
                return True
            except Exception:  # noqa: BLE001 - any failure to answer counts as lost
                return False

        alive = await asyncio.gather(*(probe(i) for i in members))
        return [i for i, ok in zip(members, alive) if not ok]

    async def load_from_disk(self, version: int, path: str) -> None:
        """Fallback: every server loads the trainer's safetensors checkpoint."""
        await self._each_server(
            f"loading weights from {path}", lambda s: s.client.update_weights_from_disk(path, version)
        )

    async def load_adapter(self, version: int, path: str) -> None:
        """model.lora.ship=adapter: every server loads the trainer's PEFT directory as `version`'s
        adapter (both engines key their prefix caches by adapter: nothing to flush)."""
        await self._each_server(
            f"loading adapter {path}", lambda s: s.client.load_lora_adapter(path, version)
        )

    async def resume(self) -> None:
        if self.pause_mode is PauseMode.drain:
            return
        await self._each_server("resume generation", lambda s: s.client.resume(), tolerate=True)

    async def _abort_until_idle(self, in_flight: Callable[[], int]) -> None:
        """Interrupt every request and wait (briefly) for the partial outputs to come back.

        SGLang's own abort-mode pause aborts and then re-checks for running requests only once a
        second, so any request in flight costs every update at least a second (measured: 1.4 s
        of a 2.8 s step on the built-in task). Aborting ourselves and watching our own count
        lets `pause` skip the server pause once everything is back. A request that reached its
        server after the abort is aborted again; whatever still runs after `_ABORT_BUDGET_S` is
        left to SGLang's abort pause.
        """
        deadline = time.monotonic() + min(_ABORT_BUDGET_S, self.step_timeout_s)
        # Once always, as the pause stage: a server that cannot answer is marked down here, so
        # the update goes on without it (a dead server found at begin_weight_update would be fatal).
        await self._each_server("abort in-flight requests", lambda s: s.client.abort_all(), tolerate=True)
        while in_flight() > 0 and time.monotonic() < deadline:
            try:
                await asyncio.wait_for(_wait_zero(in_flight, poll_s=0.005), _ABORT_RECHECK_S)
                return
            except TimeoutError:
                pass
            # a request that reached its server after the abort: abort again (errors: see above)
            await asyncio.gather(
                *(asyncio.wait_for(s.client.abort_all(), self.step_timeout_s) for s in self.pool.up_slots),
                return_exceptions=True,
            )

    async def release_memory(self) -> None:
        """The colocated schedule: every up server frees its GPU memory while the trainer steps
        (rollout/memory_release.py); a failure raises StageError naming the server."""
        await self._each_server("release GPU memory", lambda s: s.client.release_memory())

    async def resume_memory(self) -> None:
        """Take it back, before the weight update; a server that cannot is marked down."""
        await self._each_server("resume GPU memory", lambda s: s.client.resume_memory(), tolerate=True)

    async def _each_server(
        self, what: str, call: Callable[[ServerSlot], Awaitable], tolerate: bool = False
    ) -> None:
        """Run one stage on every up server at once. A server's call may repeat (the clients repeat
        safe calls until control.call_deadline_s), but a server still busy with it one stage
        timeout after another server finished is a laggard: it fails the stage, so one stalled
        server does not hold up the others. `tolerate`: a server that fails is marked down (the
        group is re-formed without it) as long as another server is left."""
        slots = self.pool.up_slots
        deadline_s = max(self.call_deadline_s, self.stage_timeout_s)
        tasks = {
            asyncio.ensure_future(run_stage(f"{what} on server {s.index}", call(s), deadline_s)): s
            for s in slots
        }
        loop = asyncio.get_running_loop()
        start, first_done = loop.time(), None
        pending = set(tasks)
        while pending:
            wait_s = None
            if first_done is not None:
                wait_s = max(0.0, max(first_done, start + self.stage_timeout_s) - loop.time())
            done, pending = await asyncio.wait(pending, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break  # the rest lag behind a server that finished
            if first_done is None and any(not t.exception() for t in done):
                first_done = loop.time()
        for task in pending:
            task.cancel()
        results: list[BaseException | None] = []
        for task, slot in tasks.items():
            if task in pending:
                results.append(
                    StageError(
                        f"{what} on server {slot.index}",
                        f"no answer {self.stage_timeout_s:.0f}s after another server's",
                    )
                )
            else:
                results.append(task.exception())
        await asyncio.gather(*pending, return_exceptions=True)
        failed = [(s, r) for s, r in zip(slots, results) if r is not None]
        if tolerate and failed and len(failed) < len(slots):
            for slot, error in failed:
                self.pool.mark_down(slot.index, str(error))
            self.forget_groups()
            return
        if failed:
            raise failed[0][1]


async def _flush_when_idle(slot: ServerSlot) -> None:
    """SGLang refuses flush_cache (HTTP 400) until its scheduler has run one idle iteration after
    the last batch; each refused call wakes it for that iteration, so a retry soon succeeds."""
    for attempt in range(_FLUSH_ATTEMPTS):
        try:
            await slot.client.flush_cache()
            return
        except ServerCallError as exc:
            if exc.status != 400 or attempt == _FLUSH_ATTEMPTS - 1:
                raise
            await asyncio.sleep(_FLUSH_RETRY_S)


async def _wait_zero(in_flight: Callable[[], int], poll_s: float = 0.02) -> None:
    t0 = time.monotonic()
    while in_flight() > 0:
        await asyncio.sleep(poll_s)
    logger.debug("drained in %.2fs", time.monotonic() - t0)
