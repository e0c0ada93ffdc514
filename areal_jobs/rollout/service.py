"""The controller process's event loop: control messages, weight updates, stats, evaluation.

Startup: evaluate the initial policy on the held-out set (servers idle, version 0), then start
admitting training prompts. Each PauseRequest from the trainer runs the weight-update handshake
to completion before the next message is read, so updates never overlap.
"""

from __future__ import annotations

import asyncio
import logging
import time

from areal_jobs.rollout.controller import RolloutController
from areal_jobs.rollout.evaluation import EvalSummary, evaluate
from areal_jobs.rollout.weight_update import StageError, WeightUpdateOrchestrator, run_stage
from areal_jobs.transport import messages as m
from areal_jobs.transport.channels import ControllerChannel

logger = logging.getLogger(__name__)


class ControllerService:
    def __init__(
        self,
        controller: RolloutController,
        orchestrator: WeightUpdateOrchestrator,
        channel: ControllerChannel,
        eval_prompts: list,
        *,
        eval_every_steps: int,
        stats_interval_s: float = 2.0,
        step_timeout_s: float = 120.0,
    ) -> None:
        self.ctl = controller
        self.orch = orchestrator
        self.channel = channel
        self.eval_prompts = eval_prompts
        self.eval_every_steps = eval_every_steps
        self.stats_interval_s = stats_interval_s
        self.step_timeout_s = step_timeout_s
        self._outbox: list[m.ControlMessage] = []  # held until a trainer has said hello
        self._background: set[asyncio.Task] = set()

    async def run(self) -> int:
        if self.eval_prompts:
            await self._eval("start", greedy=True)
        admission = asyncio.create_task(self.ctl.admission_loop(), name="admission")
        stats = asyncio.create_task(self._stats_loop(), name="stats")
        try:
            while True:
                if self.ctl.fatal is not None:
                    raise RuntimeError(f"rollout failed: {self.ctl.fatal!r}")
                msg = await self.channel.recv_control(timeout_s=1.0)
                if msg is None:
                    continue
                if isinstance(msg, m.TrainerHello):
                    self.orch.forget_groups()  # a (re)started trainer holds no broadcast group
                    await self._send(m.ControllerHello(version=self.ctl.version, num_servers=len(self.ctl.pool.up_slots)))
                    await self._flush_outbox()
                elif isinstance(msg, m.GroupsExpired):
                    self.ctl.on_expired(msg.group_ids)
                elif isinstance(msg, m.PauseRequest):
                    await self._update_weights(msg)
                elif isinstance(msg, m.Stop):
                    await self._stop(msg)
                    return 0
                else:
                    logger.warning("ignoring unexpected %s from the trainer", type(msg).__name__)
        finally:
            admission.cancel()
            stats.cancel()
            for task in self._background:
                task.cancel()

    async def _update_weights(self, req: m.PauseRequest) -> None:
        t0 = time.monotonic()
        ctl = self.ctl
        ctl.on_trained(req.trained_group_ids)
        ctl.running.clear()
        try:
            await self.orch.pause(lambda: ctl.segments_in_flight)
            init = not req.disk_path and self.orch.needs_group_init(req.senders)
            generation = self.orch.next_generation() if init else self.orch.generation
            world = ctl.pool.group_world_size()
            await self._send(m.Paused(version=req.version, world_size=world, init_group=init, group_generation=generation))
            if req.disk_path:
                await self.orch.load_from_disk(req.version, req.disk_path)
            else:
                if init:
                    await self.orch.init_groups(req.senders, req.backend)
                await self.orch.receive(req.version, req.senders)
            ctl.on_version(req.version)
            await self.orch.resume()
        except StageError as exc:
            logger.error("weight update to version %d failed at %s", req.version, exc)
            await self._send(m.UpdateFailed(version=req.version, stage=exc.stage, error=exc.detail))
            raise
        ctl.running.set()
        await self._send(m.VersionPublished(version=req.version, update_s=time.monotonic() - t0))
        if self.eval_prompts and self.eval_every_steps and req.version % self.eval_every_steps == 0:
            task = asyncio.create_task(self._eval("periodic"), name=f"eval-v{req.version}")
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _stop(self, msg: m.Stop) -> None:
        logger.info("stopping: %s", msg.reason)
        await self.ctl.stop()
        for task in list(self._background):
            task.cancel()
        for slot in self.ctl.pool.up_slots:  # the cancelled requests' server work is wasted: abort it
            await run_stage(f"abort requests on server {slot.index}", slot.client.abort_all(), self.step_timeout_s)
        if msg.final_eval and self.eval_prompts:
            await self._eval("final", greedy=True)
        await self._send(m.Stopped(num_groups_pushed=self.ctl.counters.groups_pushed, metrics=self.ctl.metrics()))

    async def _eval(self, kind: str, greedy: bool = False) -> None:
        version = self.ctl.version
        kwargs = dict(max_new_tokens=self.ctl.rollout.max_new_tokens, running=self.ctl.running)
        summary: EvalSummary = await evaluate(
            self.ctl.pool, self.ctl.scorer, self.eval_prompts, self.ctl.decode,
            temperature=self.ctl.rollout.temperature, tag=f"{kind}-v{version}", **kwargs,
        )  # fmt: skip
        await self._send(m.EvalResult(version, summary.accuracy, summary.mean_reward, summary.num_prompts, kind))
        if greedy:
            summary = await evaluate(
                self.ctl.pool, self.ctl.scorer, self.eval_prompts, self.ctl.decode,
                temperature=0.0, tag=f"{kind}-greedy-v{version}", **kwargs,
            )  # fmt: skip
            await self._send(
                m.EvalResult(version, summary.accuracy, summary.mean_reward, summary.num_prompts, f"{kind}_greedy")
            )

    async def _stats_loop(self) -> None:
        last_tokens, last_t = 0, time.monotonic()
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
