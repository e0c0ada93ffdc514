"""The controller's side of one weight update (ControllerService's PauseRequest handler): pause,
the group (re)initialisation, the receive on every server, resume and the published version; a
server lost inside the update, or a stage that was only slow, sends the version again (bounded).

A mixin of rollout/service.ControllerService, which owns the state it reads (self.ctl, pool,
orch, channel, the retry counters); kept apart because the update is the controller's longest
protocol (docs/protocols.md, "Weight update") and reads on its own.
"""

from __future__ import annotations

import logging
import time

from areal_jobs.rollout.weight_update import StageError
from areal_jobs.transport import messages as m

# the controller's logger: an update's lines read as the controller's
logger = logging.getLogger("areal_jobs.rollout.service")

MAX_UPDATE_RETRIES = m.MAX_UPDATE_RETRIES  # per version (the protocol's bound; tests lower it here)
MAX_SLOW_UPDATE_RETRIES = m.MAX_SLOW_UPDATE_RETRIES


class WeightUpdateSteps:
    async def _update_weights(self, req: m.PauseRequest) -> None:
        self._updating = True
        try:
            await self._update_weights_paused(req)
        finally:
            self._updating = False

    async def _update_weights_paused(self, req: m.PauseRequest) -> None:
        t0 = time.monotonic()
        if self._update_started is None:
            self._update_started = t0
        ctl, pool = self.ctl, self.pool
        ctl.on_trained(req.trained_group_ids, req.version)
        ctl.stop_sending()
        marks = [("start", t0)]  # stage timings, logged: where an update spends its time
        members: list[int] = []  # the servers this update is for
        try:
            await self.memory.wake()  # released while the trainer stepped: back before the update
            if not self._paused_for_retry:  # a retry finds the servers still paused
                await self.orch.pause(lambda: pool.total_in_flight)  # evaluation requests too
            marks.append(("pause", time.monotonic()))
            joined = pool.promote_joining()  # paused: safe to include them from here on
            if joined:
                logger.info("servers %s rejoin at version %d", joined, req.version)
                self.orch.forget_groups()
            if req.regroup:  # the trainer dropped its group after its half of a broadcast timed out
                self.orch.forget_groups()
            members = [s.index for s in pool.up_slots]
            broadcast = not (req.disk_path or req.adapter_path)
            init = bool(pool.up_slots) and broadcast and self.orch.needs_group_init(req.senders)
            generation = self.orch.next_generation() if init else self.orch.generation
            world = pool.group_world_size()
            held = {s.held_version for s in pool.up_slots}
            await self._send(
                m.Paused(
                    version=req.version,
                    world_size=world,
                    init_group=init,
                    group_generation=generation,
                    timeout_scale=self.orch.timeout_scale,
                    servers_version=held.pop() if len(held) == 1 else -1,
                )
            )
            if not pool.up_slots:
                logger.warning(
                    "no rollout server is up for version %d; restarted servers will ask for it", req.version
                )
            elif req.disk_path:
                await self.orch.load_from_disk(req.version, req.disk_path)
            elif req.adapter_path:
                await self.orch.load_adapter(req.version, req.adapter_path)
            else:
                if init:
                    await self.orch.init_groups(req.senders, req.backend)
                    marks.append(("groups", time.monotonic()))
                await self.orch.receive(req.version, req.senders)
                if any(s.encoded for s in req.senders):
                    await self._trainer_broadcast_done(req.version)
            marks.append(("receive", time.monotonic()))
            ctl.on_version(req.version)
            await self.orch.resume()
            marks.append(("resume", time.monotonic()))
        except StageError as exc:
            if await self._retry_update(req.version, exc, members):
                return
            logger.error("weight update to version %d failed at %s", req.version, exc)
            await self._send(m.UpdateFailed(version=req.version, stage=exc.stage, error=exc.detail))
            raise
        self._paused_for_retry = False
        for index in members:  # every member answered the whole update: alive, whatever /health said
            self._unanswered_since.pop(index, None)
        self._update_retries = self._slow_retries = 0
        self._update_started = None
        self.orch.timeout_scale = 1.0
        ctl.resume_sending()
        stage_s = {name: t - prev for (_, prev), (name, t) in zip(marks, marks[1:])}
        await self._send(
            m.VersionPublished(
                version=req.version,
                update_s=time.monotonic() - t0,
                pause_s=stage_s.get("pause", 0.0),
                receive_s=stage_s.get("groups", 0.0) + stage_s.get("receive", 0.0),
                resume_s=stage_s.get("resume", 0.0),
                bucket_calls_s=self.orch.bucket_calls_s if broadcast else 0.0,
                staleness_bound=ctl.staleness_bound,
            )
        )
        logger.info(
            "version %d on the servers in %.3fs (%s)",
            req.version,
            marks[-1][1] - t0,
            ", ".join(f"{name} {t - prev:.3f}s" for (_, prev), (name, t) in zip(marks, marks[1:])),
        )
        if (
            self.eval_prompts
            and self.eval_every_steps
            and req.version % self.eval_every_steps == 0
            and req.trained_group_ids
        ):
            self._spawn(self._eval("periodic"), f"eval-v{req.version}")

    async def _trainer_broadcast_done(self, version: int) -> None:
        """weight_sync.sync=delta: the servers hold `version` only once the trainer says every
        collective of its encoded broadcast completed (m.BroadcastDone: SGLang's loader cannot fail
        its own call when the group breaks under it). Its word missing or negative fails the stage,
        which is then sent again like any slow stage."""
        stage = f"the trainer's encoded broadcast of version {version}"
        wait_s = self.orch.stage_timeout_s
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            msg = await self.channel.recv_control(timeout_s=left)
            if msg is None:
                break
            if isinstance(msg, m.BroadcastDone) and msg.version == version:
                if msg.ok:
                    return
                self._servers_hold_nothing()
                raise StageError(
                    stage, f"broke off on the trainer (timeout or connection closed): {msg.detail}"
                )
            self._early.append(msg)
        self._servers_hold_nothing()
        raise StageError(stage, f"timed out: no word from the trainer within {wait_s:.0f}s")

    def _servers_hold_nothing(self) -> None:
        """Their calls returned, but the broadcast may not have reached them whole: a full copy next."""
        for slot in self.pool.up_slots:
            slot.held_version = -1

    async def _retry_update(self, version: int, exc: StageError, members: list[int]) -> bool:
        """A server (of the update's `members`) that died inside the update leaves the pool, and
        the trainer is asked to send the version again to the others (bounded). When every server
        still answers, the stage was slow, not broken (a starved machine, a stalled trainer): the
        version is sent again with doubled stage timeouts, within control.update_deadline_s.
        False: the failure is the update's own and fatal."""
        lost = await self.orch.find_lost(members)
        if lost:
            if self._update_retries >= MAX_UPDATE_RETRIES:
                return False
            self._update_retries += 1
            for index in lost:
                self.pool.mark_down(index, f"died during the update to version {version}: {exc}")
            logger.warning(
                "servers %s died during the update to version %d (%s); %d servers stay: sending it "
                "again (retry %d/%d)", lost, version, exc.stage, len(self.pool.up_slots),
                self._update_retries, MAX_UPDATE_RETRIES,
            )  # fmt: skip
        else:
            elapsed = time.monotonic() - (self._update_started or time.monotonic())
            if not exc.slow:
                return False  # a server refused the request: repeating cannot fix it
            if self._slow_retries >= MAX_SLOW_UPDATE_RETRIES or elapsed >= self.update_deadline_s:
                logger.error(
                    "the update to version %d failed %d times with every server answering, over %.0fs "
                    "(control.update_deadline_s=%.0f): giving up", version, self._slow_retries + 1,
                    elapsed, self.update_deadline_s,
                )  # fmt: skip
                return False
            self._slow_retries += 1
            self.orch.timeout_scale *= 2.0
            logger.warning(
                "the update to version %d failed at %s (%s) with every server answering: sending it "
                "again with stage timeouts of %.0fs (repeat %d/%d, %.0fs of control.update_deadline_s=%.0f)",
                version, exc.stage, exc.detail, self.orch.stage_timeout_s, self._slow_retries,
                MAX_SLOW_UPDATE_RETRIES, elapsed, self.update_deadline_s,
            )  # fmt: skip
        self.orch.forget_groups()
        self._paused_for_retry = True  # the survivors keep their paused requests: no mixed weights
        await self._send(m.UpdateRetry(version, tuple(lost), exc.stage, exc.detail))
        return True
