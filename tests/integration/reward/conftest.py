"""Shared fixtures for reward tests that run real subprocesses: a real RewardService on its own
event loop, small sandbox limits, and a check that no sandboxed process outlives its call."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from areal_jobs.api import RewardRequest, RewardResult
from areal_jobs.config import NetworkIsolation, RewardConfig
from areal_jobs.reward.sandbox_mode import resolve_isolation
from areal_jobs.reward.service import RewardService

REPO = Path(__file__).resolve().parents[3]
SHARED_DATA = REPO / ".." / "shared" / "data"
FIXTURES = REPO / "tests" / "fixtures"

# Small limits keep hostile programs cheap on a 2-core machine; real defaults are in RewardConfig.
SMALL_LIMITS = {
    "code_wall_timeout_s": 3.0,
    "code_cpu_s": 2,
    "code_memory_mb": 512,
    "code_max_procs": 16,
    "code_max_output_bytes": 1 << 16,
}


@dataclass
class Scorer:
    """A started RewardService plus the event loop that drives it (one loop per fixture)."""

    service: RewardService
    loop: asyncio.AbstractEventLoop

    def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        return self.loop.run_until_complete(self.service.score_group(requests))


@contextlib.contextmanager
def running_scorer(cfg: RewardConfig) -> Iterator[Scorer]:
    """A started RewardService on a fresh event loop; closed on exit."""
    loop = asyncio.new_event_loop()  # driven by run_until_complete: never made the thread's current loop
    service = RewardService(cfg)
    try:
        service.start()
        yield Scorer(service, loop)
    finally:
        service.close()
        loop.close()


@pytest.fixture(scope="session")
def small_limits() -> dict[str, float]:
    return dict(SMALL_LIMITS)


@pytest.fixture(scope="session")
def scorer_factory() -> Callable[[RewardConfig], contextlib.AbstractContextManager[Scorer]]:
    """`with scorer_factory(cfg) as s:` gives a started service with its own event loop."""
    return running_scorer


@pytest.fixture(scope="session")
def scorer() -> Iterator[Scorer]:
    """Two workers (the CI machine has 2 cores) with small sandbox limits, shared by the session
    (start-up imports cost seconds); tests that read metrics compare before and after."""
    # Without a strong mode, auto refuses to start: the weak mode is then asked for explicitly.
    isolation = NetworkIsolation.auto if strong_mode_available() else NetworkIsolation.none
    cfg = RewardConfig(num_workers=2, timeout_s=20.0, network_isolation=isolation, **SMALL_LIMITS)
    with running_scorer(cfg) as s:
        yield s


def strong_mode_available() -> bool:
    try:
        resolve_isolation(NetworkIsolation.auto)
    except RuntimeError:
        return False
    return True


@pytest.fixture(scope="session")
def namespaces() -> bool:
    """True when the sandbox runs in network/PID/mount namespaces here (netns or userns)."""
    return strong_mode_available()


def sandbox_processes() -> list[int]:
    """Pids of live sandboxed processes: boot scripts and namespace inits (by command line),
    programs (by the sandbox uid, or a cwd in a host work dir in fallback mode). Zombies and
    processes that vanish while we look are skipped."""
    prefix = os.path.join(tempfile.gettempdir(), "areal-sbx-")
    first_uid = RewardConfig().code_sandbox_uid
    sandbox_uids = {str(uid) for uid in range(first_uid, first_uid + 64)}  # one per reward worker
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
            cwd = os.readlink(f"/proc/{entry}/cwd")
            status = Path("/proc", entry, "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields["State"].split()[0] == "Z":
            continue
        if (
            b"sandbox_boot.py" in cmdline
            or cwd.startswith(prefix)
            or fields["Uid"].split()[0] in sandbox_uids
        ):
            found.append(int(entry))
    return found


def wait_until_no_sandbox_processes(limit_s: float = 10.0) -> list[int]:
    """Poll (bounded) until no sandboxed process is left; returns the survivors, if any."""
    deadline = time.monotonic() + limit_s
    survivors = sandbox_processes()
    while survivors and time.monotonic() < deadline:
        time.sleep(0.1)
        survivors = sandbox_processes()
    return survivors


@pytest.fixture(scope="session")
def leftover_sandbox_processes() -> Callable[[], list[int]]:
    """Call it after an attack: the sandboxed processes still alive after a bounded wait."""
    return wait_until_no_sandbox_processes
