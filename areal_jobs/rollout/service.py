"""The controller process's event loop: control messages, weight updates, checkpoints, server
health, stats and evaluation.

Fresh start: evaluate the initial policy on the held-out set (servers idle, version 0), then
admit training prompts. Resume: restore the snapshot, re-send its groups, and generate nothing
until the trainer has published the checkpoint's weights. Each PauseRequest runs the whole
weight-update handshake before the next message is read, so updates never overlap.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

from areal_jobs.api import Health
from areal_jobs.rollout.controller import RolloutController
from areal_jobs.rollout.evaluation import EvalSummary, evaluate
from areal_jobs.rollout.generation import GenerationPath
from areal_jobs.rollout.memory_release import ServerMemory
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.rollout.snapshot import ControllerSnapshot, save_snapshot
from areal_jobs.rollout.update_steps import WeightUpdateSteps
from areal_jobs.rollout.weight_update import WeightUpdateOrchestrator, run_stage
from areal_jobs.transport import messages as m
from areal_jobs.transport.channels import ControllerChannel
from areal_jobs.transport.discovery import ServerRecord

logger = logging.getLogger(__name__)


class ControllerService(WeightUpdateSteps):
    def __init__(
        self,
        controller: RolloutController,
        pool: ServerPool,
        orchestrator: WeightUpdateOrchestrator,
        channel: ControllerChannel,
        eval_prompts: list,
        *,
        eval_every_steps: int,
        eval_samples: int = 1,
        eval_k: int = 1,
        eval_concurrency: int = 64,
        step_timeout_s: float = 120.0,
        health_interval_s: float = 5.0,
        discover: Callable[[], list[ServerRecord]] | None = None,
        make_client: Callable[[ServerRecord], object] | None = None,
        stats_interval_s: float = 2.0,
        leaving: Callable[[], set[int]] | None = None,
        on_drained: Callable[[int], None] | None = None,
        release_memory_while_training: bool = False,
        update_deadline_s: float = 1800.0,
        health_grace_s: float = 0.0,
    ) -> None:
        self.ctl = controller
        self.pool = pool  # the controller's servers (shared with it and the orchestrator)
        self.orch = orchestrator
        self.channel = channel
        self.eval_prompts = eval_prompts
        self.eval_every_steps = eval_every_steps
        self.eval_samples = eval_samples  # answers per held-out prompt: pass@1 over them, pass@k
        self.eval_k = min(eval_k, eval_samples)
        self.eval_concurrency = eval_concurrency
        # the training samples' generation path, with its own counters (not rollout throughput)
        self.eval_path = GenerationPath(pool, controller.running, lambda: controller.version)
        self.step_timeout_s = step_timeout_s
        self.health_interval_s = health_interval_s
        self.discover = discover
        self.make_client = make_client
        self.stats_interval_s = stats_interval_s
        self.leaving = leaving  # servers asked to leave the job (launch.scale -N): drained, then let go
        self.on_drained = on_drained
        self.released: set[int] = set()  # servers answered with on_drained
        self.preempted = asyncio.Event()  # SIGUSR1/SIGTERM: finish the trainer's checkpoint, then exit
        self._outbox: list[m.ControlMessage] = []  # held until a trainer has said hello
        self._early: list[m.ControlMessage] = []  # read while waiting for BroadcastDone: served next
        self._background: set[asyncio.Task] = set()
        self._known: dict[int, ServerRecord] = {}
        self.dump_samples = None  # list[SampleRecord] -> None: each evaluation's samples (main sets it)
        # a server died inside an update: the others stay paused until the trainer's retry is in
        self._paused_for_retry = False
        self._update_retries = 0  # of the current version, for servers lost in it
        self._slow_retries = 0  # of the current version, for stages that timed out with all alive
        self._update_started: float | None = None  # the current version's first attempt
        self.update_deadline_s = update_deadline_s  # control.update_deadline_s
        # control.health_grace_s: how long a server's health probes may keep failing (without a
        # refused connection) before it is marked down; when each server's failures began
        self.health_grace_s = health_grace_s
        self._unanswered_since: dict[int, float] = {}
        self.clock = time.monotonic  # the health grace's clock (a test steps its own)
        self._updating = False  # a weight update is under way (servers paused)
        self.decode_raw = None
        # what evaluations score with: the verifier where a reward model trains the policy
        # (reward.source=model), so held-out accuracy is the checker's; None: the training scorer
        self.eval_scorer = None
        # the colocated schedule: the servers free their GPU memory while the trainer steps
        self.memory = ServerMemory(
            controller, pool, orchestrator, self._busy, enabled=release_memory_while_training
        )

    async def run(self, restored: ControllerSnapshot | None = None) -> int:
        if restored is not None:
            self.ctl.stop_sending()  # until the trainer publishes the checkpoint's weights
            for group in self.ctl.restore(restored):
                await self.channel.push_group(group)
            logger.info(
                "resumed rollout at step %d: %d groups re-sent, %d partial samples continue",
                restored.step, len(restored.retained), restored.num_partial_samples,
            )  # fmt: skip
        elif self.eval_prompts:
            await self._eval("start")
        loops = [self.ctl.admission_loop(), self._stats_loop(), self._health_loop(), self.memory.loop()]
        tasks = [asyncio.create_task(c) for c in loops]
        try:
            return await self._serve()
        finally:
            for task in (*tasks, *self._background):
                task.cancel()

    async def _serve(self) -> int:
        preempted_at: float | None = None
        while True:
            if self.ctl.fatal is not None:
                raise RuntimeError(f"rollout failed: {self.ctl.fatal!r}")
            if self.preempted.is_set():
                preempted_at = preempted_at or time.monotonic()
                if time.monotonic() - preempted_at > self.step_timeout_s:
                    logger.warning(
                        "preempted and no checkpoint request came: exiting (last checkpoint stands)"
                    )
                    return 0
            msg = self._early.pop(0) if self._early else await self.channel.recv_control(timeout_s=1.0)
            if msg is None or isinstance(msg, m.BroadcastDone):  # a broken attempt's: already retried
                continue
            if isinstance(msg, m.TrainerHello):
                self.orch.forget_groups()  # a (re)started trainer holds no broadcast group
                await self._send(
                    m.ControllerHello(version=self.ctl.version, num_servers=len(self.pool.up_slots))
                )
                await self._flush_outbox()
            elif isinstance(msg, m.GroupsExpired):
                self.ctl.on_expired(msg.group_ids)
            elif isinstance(msg, m.DriftReport):
                self.ctl.on_drift(msg.version, msg.drift, msg.staleness_mean)
            elif isinstance(msg, m.PauseRequest):
                await self._update_weights(msg)
            elif isinstance(msg, m.CheckpointRequest):
                await self._checkpoint(msg)
            elif isinstance(msg, m.Stop):
                await self._stop(msg)
                return 0
            else:
                logger.warning("ignoring unexpected %s from the trainer", type(msg).__name__)

    async def _checkpoint(self, req: m.CheckpointRequest) -> None:
        """Snapshot now (no await: consistent), write it off the event loop: generation goes on."""
        snap = self.ctl.snapshot(req.step)
        t0 = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, save_snapshot, snap, Path(req.path))
        logger.info("checkpoint step %d: rollout state saved in %.2fs", req.step, time.monotonic() - t0)
        await self._send(m.CheckpointSaved(req.step, len(snap.retained), snap.num_partial_samples))

    async def _stop(self, msg: m.Stop) -> None:
        logger.info("stopping: %s", msg.reason)
        await self.ctl.stop()
        for task in list(self._background):
            task.cancel()
        if await self.memory.wake():  # released after the last batch: the final evaluation needs them
            self.ctl.resume_sending()
        for slot in self.pool.up_slots:  # the cancelled requests' server work is wasted: abort it
            await run_stage(
                f"abort requests on server {slot.index}", slot.client.abort_all(), self.step_timeout_s
            )
        if msg.final_eval and self.eval_prompts:
            await self._eval("final")
        await self._send(
            m.Stopped(
                num_groups_pushed=self.ctl.counters.groups_pushed,
                metrics={**self.ctl.metrics(), **self.ctl.scorer.metrics()},  # reward/* too: summary.json
            )
        )

    async def _health_loop(self) -> None:
        """Mark servers that stop answering down; let restarted and added ones join (and ask for
        weights); let the ones asked to leave go."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self._probe(slot) for slot in self.pool.up_slots))
            await self._membership()

    async def _probe(self, slot) -> None:
        """One health probe. Not while an update holds the servers paused: SGLang's /health
        generates a token and so waits for the resume; the update itself finds servers that die
        in it (find_lost). A refused connection marks the server down at once (nothing listens:
        the process is gone). A probe that goes unanswered is followed by a metadata call (its
        weight version, answered by the HTTP front even when generation is slow or paused): a
        server that answers that is alive and busy, not down. Only probes that go wholly
        unanswered for control.health_grace_s mark it down, so a server stalled for a while (a
        starved node) is waited for, not dropped."""
        if self._holding_servers():
            return
        health = await slot.client.health()
        if health is Health.no_answer and not self._holding_servers():
            health = await self._answers(slot.client)
        if self._holding_servers() or health is Health.up:
            if self._unanswered_since.pop(slot.index, None) is not None:
                logger.info("server %d answers again", slot.index)
            return
        now = self.clock()
        since = self._unanswered_since.setdefault(slot.index, now)
        if health is Health.refused or now - since >= self.health_grace_s:
            self._unanswered_since.pop(slot.index, None)
            why = (
                "refused the connection" if health is Health.refused else f"unanswered for {now - since:.0f}s"
            )
            self.pool.mark_down(slot.index, f"health check failed ({why})")
            self.orch.forget_groups()
        else:
            logger.warning(
                "server %d did not answer its health probe; marked down if it still does not in %.0fs "
                "(control.health_grace_s)", slot.index, self.health_grace_s - (now - since),
            )  # fmt: skip

    async def _answers(self, client) -> Health:
        """Whether the server's HTTP front answers a metadata call within a step timeout."""
        try:
            await asyncio.wait_for(client.weight_version(), self.step_timeout_s)
            return Health.up
        except Exception:  # noqa: BLE001 - any failure to answer counts as no answer
            return Health.no_answer

    async def _membership(self) -> None:
        """Registered servers that are new to the job or back from the dead join (at the next
        update); servers asked to leave are drained and let go."""
        if self.discover is None or self.make_client is None:
            return
        leaving = self.leaving() if self.leaving is not None else set()
        for rec in self.discover():
            new = rec.index not in self.pool.slots
            if rec.index in leaving and new and rec.index not in self.released:
                # asked to leave before it was admitted (launch.scale -N right after +N): it never
                # got a request, so it may go at once
                self._release(rec.index, "before it was admitted")
            if rec.index in leaving or not (new or self.pool.can_rejoin(rec.index)):
                continue
            client = self.make_client(rec)
            # new: registered once healthy (server.py); back: its HTTP front answers (a server
            # left paused by a stale pause fails /health until the update that admits it resumes it)
            alive = await client.healthy() if new else (await self._answers(client)) is Health.up
            if not alive:
                await client.close()  # tried again at the next health interval, with a new client
                continue
            if new:
                self.pool.admit(rec.index, client)
            else:
                self.pool.rejoin(rec.index, client)
            logger.info(
                "server %d %s at %s; asking the trainer for the current weights",
                rec.index, "joins the job" if new else "is back", rec.url,
            )  # fmt: skip
            joined = "joined" if new else "rejoined"
            await self._send(m.WeightsNeeded(reason=f"server {rec.index} {joined}"))
        self._drain(leaving)

    def _drain(self, leaving: set[int]) -> None:
        """Servers asked to leave get no new request; each is let go once none of its requests is
        in flight (never in the middle of an update: the groups are re-formed without it next)."""
        for index in sorted(leaving & set(self.pool.slots)):
            slot = self.pool.slots[index]
            if not slot.draining:
                self.pool.drain(index)
                logger.info("server %d draining: no new request, %d in flight", index, slot.in_flight)
            if slot.in_flight == 0 and not self._holding_servers():
                self.pool.remove(index)
                self.orch.forget_groups()
                self._release(index, f"after {slot.completed} requests")

    def _release(self, index: int, when: str) -> None:
        logger.info("server %d drained %s: it leaves the pool", index, when)
        self.released.add(index)
        if self.on_drained is not None:
            self.on_drained(index)

    def _holding_servers(self) -> bool:
        return self._updating or self._paused_for_retry

    def _busy(self) -> bool:
        """An update holds the servers, or an evaluation may send requests any moment."""
        return self._holding_servers() or any(
            t.get_name().startswith("eval") and not t.done() for t in self._background
        )

    async def _eval(self, kind: str) -> None:
        """n sampled answers per prompt (pass@1, pass@k), then one greedy answer per prompt."""
        version = self.ctl.version
        common = dict(
            tag=f"{kind}-v{version}", concurrency=self.eval_concurrency,
            dump=self.dump_samples, decode_raw=self.decode_raw, episode=self.ctl.eval_episodes(self.eval_path),
        )  # fmt: skip
        scorer = self.eval_scorer or self.ctl.scorer
        sampled = await evaluate(
            self.eval_path, scorer, self.eval_prompts, self.ctl.decode,
            sampling=self.ctl.sampling,  # the training samples' settings and stop conditions
            samples_per_problem=self.eval_samples, ks=(self.eval_k,), **common,
        )  # fmt: skip
        await self._send(eval_result(version, kind, sampled, self.eval_k))
        common["tag"] = f"{kind}-greedy-v{version}"
        greedy = await evaluate(
            self.eval_path, scorer, self.eval_prompts, self.ctl.decode,
            sampling=dataclasses.replace(self.ctl.sampling, temperature=0.0, top_p=1.0), **common,
        )  # fmt: skip
        await self._send(eval_result(version, f"{kind}_greedy", greedy, 1))

    async def _stats_loop(self) -> None:
        last_tokens, last_t = self.ctl.counters.generated_tokens, time.monotonic()
        while True:
            await asyncio.sleep(self.stats_interval_s)
            now = time.monotonic()
            metrics = self.ctl.metrics()
            tokens = self.ctl.counters.generated_tokens
            metrics["rollout/gen_tokens_per_s"] = (tokens - last_tokens) / max(now - last_t, 1e-6)
            metrics["transport/rejected_messages"] = float(self.channel.rejected)
            metrics.update(self.ctl.scorer.metrics())
            last_tokens, last_t = tokens, now
            await self._send(m.RolloutStats(metrics=metrics))

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send(self, msg: m.ControlMessage) -> None:
        if not self.channel.has_peer:
            if not isinstance(msg, m.RolloutStats):  # stale stats are worthless; results are not
                self._outbox.append(msg)
            return
        await self.channel.send_control(msg)

    async def _flush_outbox(self) -> None:
        pending, self._outbox = self._outbox, []
        for msg in pending:
            await self.channel.send_control(msg)


def eval_result(version: int, kind: str, summary: EvalSummary, k: int) -> m.EvalResult:
    pass_at_k = (summary.pass_at_k or {}).get(k, summary.accuracy)
    return m.EvalResult(
        version, summary.accuracy, summary.mean_reward, summary.num_prompts, kind,
        summary.by_bucket, summary.bucket_sizes, pass_at_k=pass_at_k, k=k, samples_per_problem=summary.samples_per_problem,
        mean_length_tokens=summary.mean_length_tokens, truncation_rate=summary.truncation_rate,
        by_source=summary.by_source, source_sizes=summary.source_sizes,
    )  # fmt: skip
