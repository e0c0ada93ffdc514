"""The reward service: a pool of worker processes that the rollout controller awaits.

Contract (api.RewardScorer):
- `RewardService(cfg)` does no I/O; `start()` spawns `cfg.num_workers` workers; `close()` stops them.
- `await score_group(requests)` scores the G answers of a group in parallel (up to num_workers at
  a time) and returns one RewardResult per request, in order. It never blocks the event loop: work
  is handed to worker processes over pipes, and replies are picked up by the loop's reader
  callbacks (no threads, no blocking waits).
- Each call may run `cfg.timeout_s` on its worker, counted from when a worker takes it (waiting for
  a free worker does not count). A call past it returns RewardStatus.timeout, and that worker is
  SIGKILLed and replaced: a verifier stuck in C code (sympy on a huge power) cannot be interrupted
  any other way, and it must not hold a worker hostage.
- A worker that dies (crash, OOM kill) turns its call into RewardStatus.sandbox_error and is
  replaced. Neither case is ever folded silently into a 0: `metrics()` counts each status.
- A user's reward function (a task that is a function spec, reward/user_fn.py) fails by kind:
  fn_error (it raised, did not import, or its worker died), fn_timeout (past reward.timeout_s),
  fn_invalid (no finite number came back). These samples are left out of training
  (api.UNSCORED_STATUSES); the first failure's traceback is logged once per function, the rest
  are counted (reward/fn_errors, reward/fn_timeouts, reward/fn_invalid). What it returns beside
  its score is logged as reward/fn/<key>: the mean over the calls since the previous metrics().
- `start()` resolves the sandbox mode (sandbox_mode.resolve_isolation: `auto` refuses to start
  without a strong mode), logs it, and waits for every worker's start-up self-check: each one
  claims its sandbox uid (as root) and runs a trivial program in the real sandbox, then imports
  the verifiers, reporting a WorkerReady. A broken sandbox fails `start()` with the reason, not
  every later reward.

Why not concurrent.futures.ProcessPoolExecutor: it cannot kill the one worker whose call timed out
(a cancelled future keeps running), and one dead worker breaks the whole pool, failing the other
G-1 calls of the group with it. Workers here are independent, so a failure costs only its own call.
Workers are started with "spawn": the controller runs asyncio and threads, where fork is unsafe.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

from areal_jobs.api import RewardRequest, RewardResult, RewardStatus
from areal_jobs.config import FunctionIsolation, NetworkIsolation, RewardConfig
from areal_jobs.reward import registry
from areal_jobs.reward.fn_report import FnReport
from areal_jobs.reward.sandbox_mode import resolve_isolation
from areal_jobs.reward.user_fn import is_function_spec

logger = logging.getLogger(__name__)

_MAX_DETAIL_CHARS = 200
_MAX_OUTPUT_CHARS = 16_384  # a tool's text for the model (tool_python caps it itself, far lower)
_MAX_TRACE_CHARS = 8_000  # a user function's traceback, logged once
_READY_TIMEOUT_S = 120.0  # worker start: imports (math-verify, sympy) and the sandbox self-check
_SELF_CHECK = "import os\nprint('areal-sandbox-ok', os.getpid())\n"


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """A worker's first message: its start-up self-check. `error` is empty when it passed."""

    uid: int  # the sandbox uid it claimed (as root), else -1
    error: str = ""


def _self_check(limits) -> str:  # noqa: ANN001  (SandboxLimits, imported in the worker only)
    """Run a trivial program in the real sandbox; '' when it ran as it must, else why not."""
    from areal_jobs.reward.sandbox import run_program

    run = run_program({"main.py": _SELF_CHECK}, b"", limits)
    if not run.exited_cleanly:
        return run.error or f"exit status {run.returncode}: {run.stderr.decode(errors='replace')[-200:]}"
    words = run.stdout.split()
    if words[:1] != [b"areal-sandbox-ok"]:
        return f"unexpected output {run.stdout[:100]!r}"
    if limits.isolation is not NetworkIsolation.none and words[1:] != [b"2"]:
        # In a fresh PID namespace the program is pid 2 (its init is 1): anything else means it
        # shares the host's process table.
        return f"program is pid {words[1:]!r}, not 2: no PID namespace"
    return ""


def _worker_main(conn: Connection, cfg: RewardConfig, index: int) -> None:
    """Worker process: report WorkerReady, then score (task, response, reference, data_source,
    extra_info) tuples until the pipe closes, answering (RewardResult, traceback text or "").
    `cfg.network_isolation` is the mode the service resolved (never auto)."""
    import os

    from areal_jobs.reward import code
    from areal_jobs.reward.sandbox import SandboxLimits
    from areal_jobs.reward.sandbox_uids import claim_sandbox_uid

    try:
        uid = -1
        if os.geteuid() == 0:
            uid = claim_sandbox_uid(
                cfg.code_sandbox_uid, cfg.code_sandbox_uid_count, cfg.code_sandbox_uid_lock_dir
            )
        limits = SandboxLimits.from_config(cfg, uid=None if uid < 0 else uid)
        error = _self_check(limits)
    except (OSError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"
    if error:
        conn.send(WorkerReady(uid, error[:300]))
        return
    code.configure(limits)
    for task in registry.REWARD_TARGETS:  # import now, not during the first (timed) call
        try:
            registry.resolve(task)
        except ImportError:
            logger.warning("reward task %r unavailable in this worker", task)
    import math_verify  # noqa: F401  (imported lazily by math_answer; slow the first time)

    from areal_jobs.reward.user_fn import UserFunctionError
    from areal_jobs.reward.user_fn_sandbox import score_in_worker

    sandboxed = cfg.function_isolation is FunctionIsolation.sandbox
    if cfg.function and not sandboxed:  # import it now, not during the first (timed) call
        try:
            registry.resolve_user(cfg.function)
        except UserFunctionError:
            pass  # each call reports it (fn_error); the launcher's preflight normally caught it
    # ready once the imports are done: a call is timed from when it is sent, and the first one
    # would otherwise pay for math-verify, sympy and the user's file (seconds on a loaded machine)
    conn.send(WorkerReady(uid))
    while True:
        try:
            task, response, reference, data_source, extra_info = conn.recv()
        except (EOFError, OSError):
            return  # the service closed us, or the controller died
        trace = ""
        if is_function_spec(task):
            result, trace = score_in_worker(
                task, response, reference, data_source, extra_info, limits if sandboxed else None
            )
        else:
            try:
                result = registry.resolve(task)(response, reference)
            except Exception as e:  # noqa: BLE001  a broken reward fn or reference must not kill the worker
                result = RewardResult(
                    0.0, RewardStatus.sandbox_error, f"reward fn raised {type(e).__name__}: {e}"
                )
        result = replace(
            result, detail=result.detail[:_MAX_DETAIL_CHARS], output=result.output[:_MAX_OUTPUT_CHARS]
        )
        conn.send((result, trace[-_MAX_TRACE_CHARS:]))


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, ctx: mp.context.BaseContext, cfg: RewardConfig, index: int) -> None:
        self.index = index
        self.ready: WorkerReady | None = None  # its first message, read by wait_ready or _call
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn, cfg, index), name=f"reward-worker-{index}", daemon=True
        )
        self.process.start()
        child_conn.close()

    def wait_ready(self, timeout_s: float) -> WorkerReady:
        """Block until the worker's start-up self-check arrives (start() only)."""
        if self.ready is None:
            if not self.conn.poll(timeout_s):
                return WorkerReady(-1, f"no start-up report within {timeout_s:g}s")
            try:
                self.ready = self.conn.recv()
            except (EOFError, OSError):
                return WorkerReady(-1, f"died at start (exit code {self.process.exitcode})")
        return self.ready

    def kill(self) -> None:
        """SIGKILL and reap. Blocks the caller only while the kernel tears the process down."""
        self.process.kill()
        self.process.join(timeout=2)
        self.conn.close()


class RewardService:
    """Process-pool reward scorer (satisfies api.RewardScorer)."""

    def __init__(self, cfg: RewardConfig) -> None:
        self._cfg = cfg
        self._ctx = mp.get_context("spawn")
        self._idle: asyncio.Queue[_Worker] | None = None
        self._workers: list[_Worker] = []
        self._counts = {status: 0 for status in RewardStatus}
        self._calls = 0
        self._latency_sum_s = 0.0
        self._worker_restarts = 0
        self._fn = FnReport()  # users' functions: first failure logged, reward/fn/<key> means
        self.isolation: NetworkIsolation | None = None  # the sandbox mode in force, after start()

    def start(self) -> None:
        """Resolve the sandbox mode, spawn the workers and wait for their self-checks. Raises
        RuntimeError (and stops every worker) when the sandbox cannot work. Call from the thread
        that will run the event loop."""
        if self._workers:
            raise RuntimeError("RewardService.start() called twice")
        requested = self._cfg.network_isolation
        self.isolation = resolve_isolation(requested)
        self._cfg = replace(self._cfg, network_isolation=self.isolation)  # workers never re-resolve
        self._idle = asyncio.Queue()
        for i in range(self._cfg.num_workers):
            worker = _Worker(self._ctx, self._cfg, i)
            self._workers.append(worker)
            self._idle.put_nowait(worker)
        reports = [w.wait_ready(_READY_TIMEOUT_S) for w in self._workers]
        failed = [(w.index, r.error) for w, r in zip(self._workers, reports, strict=True) if r.error]
        if failed:
            self.close()
            index, error = failed[0]
            raise RuntimeError(
                f"reward sandbox self-check failed (reward.network_isolation={self.isolation.value}, "
                f"worker {index}): {error}"
            )
        uids = [r.uid for r in reports if r.uid >= 0]
        logger.info(
            "reward sandbox: mode %s (reward.network_isolation=%s)%s",
            self.isolation.value,
            requested.value,
            f", sandbox uids {uids}" if uids else "",
        )

    def close(self) -> None:
        """Stop every worker (and, through their death signal, any sandboxed program they run)."""
        for worker in self._workers:
            worker.kill()
        self._workers.clear()
        self._idle = None

    async def score_group(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        """Score all requests in parallel; results are in request order."""
        for request in requests:
            registry.target(request.task)  # unknown task: a config error, raised before any work
        return list(await asyncio.gather(*(self._score_one(r) for r in requests)))

    async def _score_one(self, request: RewardRequest) -> RewardResult:
        if self._idle is None:
            raise RuntimeError("RewardService.score_group() before start() or after close()")
        worker = await self._idle.get()
        start_s = time.monotonic()
        try:
            result = await self._call(worker, request)
        finally:
            if self._idle is not None:  # not closed meanwhile
                self._idle.put_nowait(worker if worker.process.is_alive() else self._replace(worker))
        self._calls += 1
        self._latency_sum_s += time.monotonic() - start_s
        self._counts[result.status] += 1
        return result

    async def _call(self, worker: _Worker, request: RewardRequest) -> RewardResult:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[RewardResult] = loop.create_future()

        def on_readable() -> None:
            if reply.done():
                return
            try:
                message = worker.conn.recv()
            except (EOFError, OSError) as e:
                reply.set_exception(e)
                return
            if isinstance(message, WorkerReady):  # a replacement's start-up report comes first
                worker.ready = message
                if message.error:
                    reply.set_result(
                        RewardResult(0.0, RewardStatus.sandbox_error, f"self-check: {message.error}")
                    )
                return
            result, trace = message
            if is_function_spec(request.task):
                self._fn.on_result(request.task, result, trace)
            reply.set_result(result)

        fd = worker.conn.fileno()
        loop.add_reader(fd, on_readable)
        try:
            # A pickled request of a few KiB fits the pipe buffer, and an idle worker is blocked
            # in recv(), so this send returns at once.
            worker.conn.send(
                (request.task, request.response, request.reference, request.data_source, request.extra_info)
            )
            return await asyncio.wait_for(reply, timeout=self._cfg.timeout_s)
        except TimeoutError:
            worker.kill()  # it may be stuck in uninterruptible C code: the only way to free it
            if is_function_spec(request.task):
                return self._fn.timed_out(request.task, self._cfg.timeout_s)
            return RewardResult(0.0, RewardStatus.timeout, f"reward call exceeded {self._cfg.timeout_s:g}s")
        except (EOFError, OSError):
            worker.kill()
            code = worker.process.exitcode
            if is_function_spec(request.task):  # the user's code took its worker down
                return self._fn.worker_died(request.task, code)
            return RewardResult(0.0, RewardStatus.sandbox_error, f"reward worker died (exit code {code})")
        except asyncio.CancelledError:
            worker.kill()  # its reply would otherwise be read as the answer to the next request
            raise
        finally:
            loop.remove_reader(fd)

    def _replace(self, dead: _Worker) -> _Worker:
        index = self._workers.index(dead)
        self._workers[index] = _Worker(self._ctx, self._cfg, index)
        self._worker_restarts += 1
        logger.warning("reward worker %d replaced (%d replacements so far)", index, self._worker_restarts)
        return self._workers[index]

    def worker_pids(self) -> list[int]:
        """Pids of the current workers (for health checks and tests)."""
        return [w.process.pid for w in self._workers if w.process.pid is not None]

    def metrics(self) -> dict[str, float]:
        """Flat counters since start under reward/, plus the busy-worker gauge."""
        idle = self._idle.qsize() if self._idle is not None else 0
        return {
            "reward/calls": float(self._calls),
            "reward/ok": float(self._counts[RewardStatus.ok]),
            "reward/timeouts": float(self._counts[RewardStatus.timeout]),
            "reward/sandbox_errors": float(self._counts[RewardStatus.sandbox_error]),
            "reward/parse_errors": float(self._counts[RewardStatus.parse_error]),
            "reward/grader_errors": float(self._counts[RewardStatus.grader_error]),
            "reward/fn_errors": float(self._counts[RewardStatus.fn_error]),
            "reward/fn_timeouts": float(self._counts[RewardStatus.fn_timeout]),
            "reward/fn_invalid": float(self._counts[RewardStatus.fn_invalid]),
            "reward/mean_latency_s": self._latency_sum_s / self._calls if self._calls else 0.0,
            "reward/worker_restarts": float(self._worker_restarts),
            "reward/busy_workers": float(len(self._workers) - idle),
            # 1.0 under the mode in force, so the run's metrics (and summary.json) name it
            **({f"reward/isolation_{self.isolation.value}": 1.0} if self.isolation else {}),
            **self._fn.metrics(),  # reward/fn/<key>: means since the previous call
        }
