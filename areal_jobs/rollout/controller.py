"""The rollout controller: one asyncio process that owns all rollout state.

    admission ──▶ group task ──▶ G sample tasks ──▶ rewards ──▶ push TrajectoryGroup
        ▲ staleness bound              │ interrupted by a weight update: wait, then re-send
        └──── trainer versions ◀───────┘ prompt + partial output (KV recomputed, new weights)

Every output token keeps the behaviour log-prob and the policy version it was sampled under.
Sending, failover and continuation live in generation.py (GenerationPath), which evaluation
drives too. A sample is an episode: the configured workflow (rollout/workflow=..., agent/) runs
it through an EpisodeContext over that same path; single_turn groups keep one batched
score_group call per group.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from areal_jobs.agent import registry, single_turn
from areal_jobs.agent.context import EpisodeContext, EpisodeServices, EpisodeText, ToolRunner, run_episode
from areal_jobs.agent.episode import EpisodeState as SampleState
from areal_jobs.api import UNSCORED_STATUSES, RewardRequest, RewardResult, RewardScorer
from areal_jobs.config import AlgoConfig, RolloutConfig
from areal_jobs.data.prompts import Prompt, PromptStream
from areal_jobs.rollout.evaluation import EvalEpisode, workflow_episodes
from areal_jobs.rollout.generation import GenerationCounters, GenerationPath, Sampling
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.rollout.snapshot import ControllerSnapshot, PartialGroup, to_trajectory
from areal_jobs.staleness import StalenessManager, may_push
from areal_jobs.staleness_bound import StalenessBoundLaw, bound_params
from areal_jobs.transport import messages as m

logger = logging.getLogger(__name__)


@dataclass
class RolloutCounters(GenerationCounters):
    """The generation path's counters (it counts into this object) and the controller's own."""

    groups_pushed: int = 0
    discarded_groups: int = 0  # dynamic sampling: all-equal-reward groups dropped and replaced
    discards_in_a_row: int = 0
    held_groups: int = 0  # finished groups held back to keep a slot for an older one (may_push)
    episodes: int = 0  # finished episodes (samples), their model turns and tool calls
    episode_turns: int = 0
    episode_tool_calls: int = 0


class RolloutController:
    """Drives generation for training. Plain object: channels and clients are injected."""

    def __init__(
        self,
        rollout: RolloutConfig,
        algo: AlgoConfig,
        pool: ServerPool,
        scorer: RewardScorer,
        stream: PromptStream,
        decode: callable,
        push: callable,
        stop_token_ids: tuple[int, ...] = (),
        text: EpisodeText | None = None,
        call_tool: ToolRunner | None = None,
        max_context_tokens: int = 0,
    ) -> None:
        self.rollout = rollout
        self.algo = algo
        self.pool = pool
        self.scorer = scorer
        self.stream = stream
        self.decode = decode  # token ids -> text, for the reward functions
        self.push = push  # async: TrajectoryGroup -> None
        self.staleness = StalenessManager(
            algo.batch_size, algo.max_staleness, max(1, rollout.max_concurrent // algo.group_size)
        )
        # algo.max_staleness=auto: the law moves the admission bound (from the ceiling down) on
        # the trainer's DriftReports; the freshness checks (trainer, hold) keep the ceiling, so a
        # group admitted under a higher bound is still trained (areal_jobs/staleness_bound.py)
        self.bound_law = StalenessBoundLaw(bound_params(algo)) if algo.staleness_auto else None
        self._drift_version = -1  # the last version whose DriftReport the law took
        self.version = 0
        self.counters = RolloutCounters()
        self.running = asyncio.Event()  # set: samples may send requests; cleared during updates
        self.running.set()
        self.requeued: deque[tuple[int, int]] = deque()  # (data index, attempt): expired groups to redo
        self.in_progress: dict[str, PartialGroup] = {}  # admitted groups not yet pushed, by group id
        self.unacked: dict[str, m.TrajectoryGroup] = {}  # pushed, not yet reported trained
        self._tasks: set[asyncio.Task] = set()
        self._wakeup = asyncio.Event()
        self._admitted_at: dict[str, int] = {}  # group id -> version when admitted (in progress)
        # the trainer's version: ahead of `version` while an update is under way; the hold counts
        # batches from it (else the batch just trained would look like free slots until it lands)
        self.trainer_version = 0
        self._stopping = False
        # failover, interruption and version stamping: the same path evaluation uses
        self.generation = GenerationPath(pool, self.running, lambda: self.version, self.counters)
        self.sampling = Sampling(
            rollout.max_new_tokens, rollout.temperature, rollout.top_p, stop_token_ids, tuple(rollout.stop)
        )
        self.workflow_name = rollout.workflow.name
        # resolved on first use: a unit test may build a controller for a workflow it never runs
        self._workflow = None
        self.episode_services = EpisodeServices(
            generate=self._generate_turn,
            version=lambda: self.version,
            text=text
            or EpisodeText(_no_encode, decode, decode, lambda role, content: ("", f"\n{content}\n")),
            score=self._score_one,
            max_new_tokens=rollout.max_new_tokens,
            call_tool=call_tool,
            max_context_tokens=max_context_tokens,
        )
        self.fatal: BaseException | None = None  # a group task's unexpected error ends the run
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
                self._start_group(prompt, attempt)
                continue
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=1.0)
            except TimeoutError:
                pass

    def _start_group(self, prompt: Prompt, attempt: int, states: list[SampleState] | None = None) -> None:
        """Register the group as in progress (synchronously: snapshots must see it) and run it."""
        group_id = f"g{prompt.data_index}" + (f"r{attempt}" if attempt else "")
        states = states or [SampleState(f"{group_id}/{i}") for i in range(self.algo.group_size)]
        self.in_progress[group_id] = PartialGroup(prompt.data_index, attempt, states)
        # its tokens are sampled under this version or later (tokens come back only when a request
        # returns, so a long answer in flight shows none): the hold's deadlines start here
        self._admitted_at[group_id] = self.version
        task = asyncio.create_task(
            self._run_group(prompt, attempt, group_id, states), name=f"group-{prompt.data_index}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("group task %s failed: %r", task.get_name(), task.exception())
            self.fatal = task.exception()

    def stop_sending(self) -> None:
        """No new /generate request until resume_sending (weight updates, restores)."""
        self.running.clear()

    def resume_sending(self) -> None:
        self.running.set()

    def on_version(self, version: int) -> None:
        self.version = version
        self._wakeup.set()

    def on_trained(self, group_ids: tuple[str, ...], version: int | None = None) -> None:
        """The trainer trained `group_ids` and now holds `version` (the servers get it next)."""
        for gid in group_ids:
            self.unacked.pop(gid, None)
        if version is not None:
            self.trainer_version = max(self.trainer_version, version)
        self._wakeup.set()  # held groups may go now

    @property
    def staleness_bound(self) -> int:
        """The admission bound eta in force (algo.max_staleness, or the law's under auto)."""
        return self.staleness.max_staleness

    def on_drift(self, version: int, drift: float, staleness_mean: float) -> None:
        """The trainer's drift for the step that produces `version` (a DriftReport): one law
        update per version (a report sent again after a restart changes nothing)."""
        if self.bound_law is None or version <= self._drift_version:
            return
        self._drift_version = version
        before = self.staleness_bound
        bound = self.bound_law.update(drift, staleness_mean)
        if bound != before:
            logger.info(
                "staleness bound %d -> %d at version %d (drift %.3g over the last %d steps, target %.3g)",
                before, bound, version, self.bound_law.smoothed, len(self.bound_law.drifts),
                self.bound_law.p.target,
            )  # fmt: skip
            self.staleness.set_bound(bound)
            self._wakeup.set()  # a higher bound admits at once

    def on_expired(self, group_ids: tuple[str, ...]) -> None:
        """Groups too stale to train are generated again from the same prompt (nothing lost)."""
        for gid in group_ids:
            group = self.unacked.pop(gid, None)
            if group is None:
                logger.warning("trainer expired unknown group %s", gid)
                continue
            self.staleness.on_expired()
            self.requeued.append((group.data_index, group.attempt + 1))
        self._wakeup.set()

    # ------------------------------------------------------------------ one group

    async def _run_group(
        self, prompt: Prompt, attempt: int, group_id: str, states: list[SampleState]
    ) -> None:
        """Run, score and push one group; episodes restored from a checkpoint continue."""
        t0 = time.monotonic()
        if self.workflow_name == "single_turn":
            # today's path: every answer, then one batched score_group call for the group
            await asyncio.gather(
                *(self._run_episode(prompt, s, single_turn.answer) for s in states if not s.done)
            )
            t_gen = time.monotonic()
            pending = [s for s in states if not s.done]
            prompt_text = self.episode_services.text.decode_raw(prompt.input_ids)  # what a reward model reads
            results = await self.scorer.score_group(
                [
                    RewardRequest(
                        prompt.reward_task,
                        self.decode(s.output_ids),
                        prompt.reference,
                        prompt_text,
                        prompt.data_source,
                        prompt.extra_info,
                    )
                    for s in pending
                ]
            )
            for s, r in zip(pending, results, strict=True):
                s.reward, s.reward_status = r.reward, r.status.value
        else:
            workflow = self._resolve_workflow()
            await asyncio.gather(*(self._run_episode(prompt, s, workflow) for s in states if not s.done))
            t_gen = time.monotonic()
        samples = tuple(to_trajectory(s, len(prompt.input_ids)) for s in states)
        group = m.TrajectoryGroup(
            group_id=group_id,
            data_index=prompt.data_index,
            prompt_ids=np.asarray(prompt.input_ids, dtype=np.int32),
            samples=samples,
            gen_time_s=t_gen - t0,
            reward_time_s=time.monotonic() - t_gen,  # single_turn; other workflows score inside gen_time_s
            attempt=attempt,
            source=prompt.source,
        )
        scored = {s.reward for s in samples if s.reward_status not in UNSCORED_STATUSES}
        if self.algo.filter_uniform_groups and len(scored) <= 1:
            self._discard(group_id)
            return
        self.counters.discards_in_a_row = 0
        await self._hold_for_older_groups(group_id, group.oldest_version)
        # no await between here and the push's first await: a snapshot sees the group in exactly
        # one place (in progress, or retained as unacked)
        del self.in_progress[group_id]
        self._admitted_at.pop(group_id, None)
        self.staleness.on_accepted()
        self.unacked[group_id] = group
        await self.push(group)
        self.counters.groups_pushed += 1
        self._wakeup.set()

    async def _hold_for_older_groups(self, group_id: str, oldest_version: int) -> None:
        """Wait while pushing this group would let the trainer fill the batches an older group
        in flight must join before its deadline (data/staleness.may_push). Bounded: the group with
        the earliest deadline always goes, and every version or trained batch re-checks."""
        eta, held = self.algo.max_staleness, False
        while not self._stopping:
            others = [self._deadline(gid, g) for gid, g in self.in_progress.items() if gid != group_id]
            version = max(self.version, self.trainer_version)
            if may_push(oldest_version + eta, version, len(self.unacked), others, self.algo.batch_size):
                return
            if not held:
                held = True
                self.counters.held_groups += 1
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=1.0)
            except TimeoutError:
                pass

    def _deadline(self, group_id: str, group: PartialGroup) -> int:
        """The last trainer version that may train `group`: its oldest token's version + eta,
        where tokens still in flight count as sampled when the group was admitted."""
        firsts = [min(s.versions) for s in group.samples if s.versions]
        return min([*firsts, self._admitted_at.get(group_id, self.version)]) + self.algo.max_staleness

    def _discard(self, group_id: str) -> None:
        """DAPO dynamic sampling: a group without signal frees its staleness slot, so admission
        starts a new prompt in its place and every batch still has B groups with signal."""
        del self.in_progress[group_id]
        self._admitted_at.pop(group_id, None)
        self.staleness.on_rejected()
        self.counters.discarded_groups += 1
        self.counters.discards_in_a_row += 1
        self._wakeup.set()
        if self.counters.discards_in_a_row >= self.algo.max_discarded_groups:
            raise RuntimeError(
                f"{self.counters.discards_in_a_row} groups in a row had all-equal rewards (no signal) "
                "under algo.filter_uniform_groups=true: the task is too easy or too hard for the model; "
                "raise algo.max_discarded_groups or set algo.filter_uniform_groups=false"
            )

    async def _run_episode(self, prompt: Prompt, state: SampleState, workflow) -> None:
        """One episode through the workflow (a restored one replays its recording first).
        The single_turn fast path passes `single_turn.answer`: generation only, scored by the group."""
        ctx = EpisodeContext(
            prompt, self.rollout.workflow, state, self.episode_services, f"{self.run_nonce}-{state.sample_id}"
        )
        if workflow is single_turn.answer:
            await workflow(ctx)
        else:
            await run_episode(workflow, ctx)
        self.counters.episodes += 1
        self.counters.episode_turns += state.num_turns
        self.counters.episode_tool_calls += state.num_tool_calls

    def eval_episodes(self, path: GenerationPath) -> EvalEpisode | None:
        """How evaluation runs an answer: None for single_turn (one turn each, scored in a batch,
        as ever); otherwise an episode of the run's workflow on `path`, so that a tool workflow
        is measured with its tools."""
        if self.workflow_name == "single_turn":
            return None
        return workflow_episodes(self._resolve_workflow(), self.rollout.workflow, self.episode_services, path)

    async def _generate_turn(
        self, rid: str, prompt_ids: list[int], state: SampleState, max_new_tokens: int, stop
    ) -> str:
        return await self.generation.run(rid, prompt_ids, state, self.sampling.for_turn(max_new_tokens, stop))

    async def _score_one(self, request: RewardRequest) -> RewardResult:
        (result,) = await self.scorer.score_group([request])
        return result

    def _resolve_workflow(self):
        if self._workflow is None:
            self._workflow = registry.resolve(self.workflow_name)
        return self._workflow

    # ------------------------------------------------------------------ checkpoints

    def snapshot(self, step: int) -> ControllerSnapshot:
        """A consistent copy of the rollout state. Synchronous: no other coroutine runs meanwhile."""
        copy = [
            PartialGroup(g.data_index, g.attempt, [SampleState(**asdict(s)) for s in g.samples])
            for g in self.in_progress.values()
        ]
        return ControllerSnapshot(
            step=step,
            version=self.version,
            stream_position=self.stream.position,
            staleness=self.staleness.state_dict(),
            requeued=list(self.requeued),
            counters=dict(asdict(self.counters)),
            partial=copy,
            retained=list(self.unacked.values()),
            bound_law=self.bound_law.state_dict() if self.bound_law else {},
            drift_version=self._drift_version,
        )

    def restore(self, snap: ControllerSnapshot) -> list[m.TrajectoryGroup]:
        """Resume from a snapshot; returns the groups to re-send to the trainer.

        Partial groups restart as tasks that continue each sample from its saved tokens; they
        wait on `running`, so nothing is generated before the servers hold the saved version.
        """
        self.version = snap.version
        self.stream.position = snap.stream_position
        state = dict(snap.staleness)
        state["running"] = len(snap.partial)
        self.staleness.load_state_dict(state)
        if self.bound_law is not None and snap.bound_law:  # else: the law starts again at the ceiling
            self.bound_law.load_state_dict(snap.bound_law)
            self.staleness.set_bound(self.bound_law.bound)
            self._drift_version = snap.drift_version
        self.requeued = deque(tuple(x) for x in snap.requeued)
        for name, value in snap.counters.items():  # in place: the generation path counts into it
            setattr(self.counters, name, value)
        for group in snap.partial:
            self._start_group(self.stream.at(group.data_index), group.attempt, group.samples)
        self.unacked = {g.group_id: g for g in snap.retained}
        return list(snap.retained)

    # ------------------------------------------------------------------ lifecycle

    @property
    def segments_in_flight(self) -> int:
        return self.generation.in_flight

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
            "rollout/staleness_bound": float(self.staleness_bound),  # staleness/bound: the exact one per step
            "rollout/groups_pushed": float(c.groups_pushed),
            "rollout/requests_in_flight": float(self.generation.in_flight),
            "rollout/generated_tokens": float(c.generated_tokens),
            "rollout/interrupted_requests": float(c.interrupted_requests),
            "rollout/resubmitted_segments": float(c.resubmitted_segments),
            "rollout/reprefill_tokens": float(c.reprefill_tokens),
            "rollout/straddled_segments": float(c.straddled_segments),
            "rollout/server_errors": float(c.server_errors),
            "rollout/servers_up": float(len(self.pool.up_slots)),
            "rollout/requeued_groups": float(len(self.requeued)),
            "buffer/discarded_groups": float(c.discarded_groups),
            "buffer/held_groups": float(c.held_groups),
            "rollout/turns_per_episode": c.episode_turns / max(c.episodes, 1),
            "rollout/tool_calls_per_episode": c.episode_tool_calls / max(c.episodes, 1),
        }


def _no_encode(text: str) -> list[int]:
    raise RuntimeError(
        "this controller was built without a tokenizer (text=EpisodeText(...)): no workflow can encode"
    )
