"""The rollout controller: one asyncio process that owns all rollout state.

    admission ──▶ group task ──▶ G sample tasks ──▶ rewards ──▶ push TrajectoryGroup
        ▲ staleness bound              │ interrupted by a weight update: wait, then re-send
        └──── trainer versions ◀───────┘ prompt + partial output (KV recomputed, new weights)

Every output token keeps the behaviour log-prob and the policy version it was sampled under.
A segment whose tokens may straddle an update (in_place pause) is stamped with the older
version, so staleness is never under-counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from areal_jobs.api import FinishReason, GenerateRequest, RewardRequest, RewardScorer
from areal_jobs.config import AlgoConfig, RolloutConfig
from areal_jobs.data.prompts import Prompt, PromptStream
from areal_jobs.rollout.server_pool import NoServerAvailable, ServerPool
from areal_jobs.rollout.sglang_client import ServerCallError
from areal_jobs.rollout.staleness import StalenessManager
from areal_jobs.transport import messages as m

logger = logging.getLogger(__name__)

_MAX_SEGMENTS = 10_000  # a sample is re-sent at most this often (every update interrupts it once)


@dataclass
class SampleState:
    """A sample in progress: what was generated so far survives interruptions (and checkpoints)."""

    sample_id: str
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    interruptions: int = 0
    finish_reason: str = ""


@dataclass
class RolloutCounters:
    generated_tokens: int = 0
    interrupted_requests: int = 0
    groups_pushed: int = 0
    server_errors: int = 0
    segments: int = 0


class RolloutController:
    """Drives generation for training. Plain object: channels and clients are injected."""

    def __init__(
        self,
        rollout: RolloutConfig,
        algo: AlgoConfig,
        pool: ServerPool,
        scorer: RewardScorer,
        stream: PromptStream,
        decode: "callable",
        push: "callable",
    ) -> None:
        self.rollout = rollout
        self.algo = algo
        self.pool = pool
        self.scorer = scorer
        self.stream = stream
        self.decode = decode  # token ids -> text, for the reward functions
        self.push = push  # async: TrajectoryGroup -> None
        self.staleness = StalenessManager(algo.batch_size, algo.max_staleness, max(1, rollout.max_concurrent // algo.group_size))
        self.version = 0
        self.counters = RolloutCounters()
        self.running = asyncio.Event()  # set: samples may send requests; cleared during updates
        self.running.set()
        self.requeued: deque[tuple[int, int]] = deque()  # (data index, attempt): expired groups to redo
        self.samples: dict[str, SampleState] = {}  # in progress, by sample id
        self.unacked: dict[str, m.TrajectoryGroup] = {}  # pushed, not yet reported trained
        self._tasks: set[asyncio.Task] = set()
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._segments_in_flight = 0
        # request ids stay unique on a server that outlives this controller (restart, resume)
        self.run_nonce = uuid.uuid4().hex[:8]

    # ------------------------------------------------------------------ admission

    async def admission_loop(self) -> None:
        """Start a group whenever the staleness bound and concurrency allow."""
        while not self._stopping:
            await self.running.wait()
            if self.staleness.try_admit(self.version):
                if self.requeued:
                    index, attempt = self.requeued.popleft()
                    prompt = self.stream.at(index)
                else:
                    prompt, attempt = self.stream.next(), 0
                task = asyncio.create_task(self._run_group(prompt, attempt), name=f"group-{prompt.data_index}")
                self._tasks.add(task)
                task.add_done_callback(self._task_done)
                continue
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("group task %s failed: %r", task.get_name(), task.exception())
            self.fatal = task.exception()

    fatal: BaseException | None = None

    def on_version(self, version: int) -> None:
        self.version = version
        self._wakeup.set()

    def on_trained(self, group_ids: tuple[str, ...]) -> None:
        for gid in group_ids:
            self.unacked.pop(gid, None)

    def on_expired(self, group_ids: tuple[str, ...]) -> None:
        """Groups too stale to train are generated again from the same prompt (nothing lost)."""
        for gid in group_ids:
            group = self.unacked.pop(gid, None)
            if group is None:
                logger.warning("trainer expired unknown group %s", gid)
                continue
            self.staleness.on_expired()
            attempt = int(gid.partition("r")[2] or 0) + 1
            self.requeued.append((group.data_index, attempt))
        self._wakeup.set()

    # ------------------------------------------------------------------ one group

    async def _run_group(self, prompt: Prompt, attempt: int) -> None:
        t0 = time.monotonic()
        group_id = f"g{prompt.data_index}" + (f"r{attempt}" if attempt else "")
        states = [SampleState(f"{group_id}/{i}") for i in range(self.algo.group_size)]
        await asyncio.gather(*(self._run_sample(prompt, s) for s in states))
        t_gen = time.monotonic()
        texts = [self.decode(s.output_ids) for s in states]
        results = await self.scorer.score_group(
            [RewardRequest(prompt.reward_task, text, prompt.reference) for text in texts]
        )
        samples = tuple(
            m.SampleTrajectory(
                sample_id=s.sample_id,
                output_ids=np.asarray(s.output_ids, dtype=np.int32),
                logprobs=np.asarray(s.logprobs, dtype=np.float32),
                versions=np.asarray(s.versions, dtype=np.int32),
                reward=r.reward,
                reward_status=r.status.value,
                finish_reason=s.finish_reason,
                num_interruptions=s.interruptions,
            )
            for s, r in zip(states, results)
        )
        group = m.TrajectoryGroup(
            group_id=group_id,
            data_index=prompt.data_index,
            prompt_ids=np.asarray(prompt.input_ids, dtype=np.int32),
            samples=samples,
            gen_time_s=t_gen - t0,
            reward_time_s=time.monotonic() - t_gen,
        )
        for s in states:
            self.samples.pop(s.sample_id, None)
        self.staleness.on_accepted()
        self.unacked[group_id] = group
        await self.push(group)
        self.counters.groups_pushed += 1
        self._wakeup.set()

    async def _run_sample(self, prompt: Prompt, state: SampleState) -> None:
        """Generate one answer, continuing it across interruptions until stop or length."""
        self.samples[state.sample_id] = state
        for segment in range(_MAX_SEGMENTS):
            remaining = self.rollout.max_new_tokens - len(state.output_ids)
            if remaining <= 0:
                state.finish_reason = "length"
                return
            await self.running.wait()
            try:
                slot = self.pool.least_loaded()
            except NoServerAvailable:
                await asyncio.sleep(1.0)  # bounded by the loop; servers come back or the job fails
                continue
            sent_version = self.version
            request = GenerateRequest(
                rid=f"{self.run_nonce}-{state.sample_id}.{segment}",
                input_ids=prompt.input_ids + state.output_ids,
                max_new_tokens=remaining,
                temperature=self.rollout.temperature,
                top_p=self.rollout.top_p,
            )
            slot.in_flight += 1
            self._segments_in_flight += 1
            try:
                response = await slot.client.generate(request)
            except ServerCallError as exc:
                if exc.is_client_error:
                    raise  # our request was wrong: failing over would repeat it everywhere
                self.counters.server_errors += 1
                self.pool.mark_down(slot.index, str(exc))
                continue  # re-sent (with its partial output) to another server
            finally:
                slot.in_flight -= 1
                self._segments_in_flight -= 1
            self.counters.segments += 1
            # a segment that straddled an update carries the older version for all its tokens
            version = min(sent_version, response.weight_version)
            state.output_ids += response.output_ids
            state.logprobs += response.logprobs
            state.versions += [version] * len(response.output_ids)
            self.counters.generated_tokens += len(response.output_ids)
            if response.finish_reason is FinishReason.abort:
                state.interruptions += 1
                self.counters.interrupted_requests += 1
                continue
            state.finish_reason = response.finish_reason.value
            return
        raise RuntimeError(f"sample {state.sample_id} was interrupted {_MAX_SEGMENTS} times")

    # ------------------------------------------------------------------ lifecycle

    @property
    def segments_in_flight(self) -> int:
        return self._segments_in_flight

    async def stop(self) -> None:
        """Stop admitting and cancel every group in progress (training is over)."""
        self._stopping = True
        self._wakeup.set()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def metrics(self) -> dict[str, float]:
        st = self.staleness.state
        c = self.counters
        return {
            "rollout/version": float(self.version),
            "rollout/groups_running": float(st.running),
            "rollout/groups_accepted": float(st.accepted),
            "rollout/groups_pushed": float(c.groups_pushed),
            "rollout/requests_in_flight": float(self._segments_in_flight),
            "rollout/generated_tokens": float(c.generated_tokens),
            "rollout/interrupted_requests": float(c.interrupted_requests),
            "rollout/server_errors": float(c.server_errors),
            "rollout/servers_up": float(len(self.pool.up_slots)),
            "rollout/requeued_groups": float(len(self.requeued)),
        }
