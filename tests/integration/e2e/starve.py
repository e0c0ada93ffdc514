"""A CPU share of a few percent for a set of processes, started and stopped by the test itself.

The real mechanism first: a cgroup's CPU quota (v1 `cpu.cfs_quota_us`, v2 `cpu.max`), exactly
what a neighbour's job or an over-subscribed node does to a run (its processes get `share` of one
CPU between them, in 1 ms slices of every 100 ms). Processes forked by a member later (a restarted
reward worker) are members too. Where no cgroup is writable (not root, no delegation), the same
share by SIGSTOP/SIGCONT duty cycles over the process tree, re-read every period.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

PERIOD_US = 100_000
_V1 = Path("/sys/fs/cgroup/cpu")
_V2 = Path("/sys/fs/cgroup")


def _writable_cgroup_root() -> tuple[Path, str] | None:
    if (_V1 / "cpu.cfs_quota_us").exists() and os.access(_V1, os.W_OK):
        return _V1, "v1"
    if (_V2 / "cgroup.controllers").exists() and os.access(_V2, os.W_OK):
        if "cpu" in (_V2 / "cgroup.subtree_control").read_text().split():
            return _V2, "v2"
    return None


class CpuStarver:
    """`with CpuStarver(pids_fn, share):` every process of `pids_fn()` (read now, and again each
    period in the fallback) runs on `share` of one CPU, together."""

    def __init__(self, pids_fn, share: float, name: str = "areal-test-starve") -> None:
        self.pids_fn, self.share, self.name = pids_fn, share, name
        root = _writable_cgroup_root()
        self.mechanism = f"cgroup {root[1]}" if root else "SIGSTOP/SIGCONT duty cycle"
        self._root = root
        self._group: Path | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> CpuStarver:
        if self._root is not None:
            root, version = self._root
            self._group = root / f"{self.name}-{os.getpid()}"
            self._group.mkdir(exist_ok=True)
            quota = max(1000, int(PERIOD_US * self.share))
            if version == "v1":
                (self._group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self._group / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (self._group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            for pid in self.pids_fn():
                try:
                    (self._group / "cgroup.procs").write_text(str(pid))
                except OSError:  # gone meanwhile
                    pass
        else:
            self._thread = threading.Thread(target=self._duty_cycle, daemon=True)
            self._thread.start()
        return self

    def _duty_cycle(self) -> None:
        period_s = PERIOD_US / 1e6
        while not self._stop.is_set():
            pids = self.pids_fn()
            self._signal(pids, signal.SIGCONT)
            time.sleep(period_s * self.share)
            self._signal(pids, signal.SIGSTOP)
            self._stop.wait(period_s * (1 - self.share))
        self._signal(self.pids_fn(), signal.SIGCONT)

    @staticmethod
    def _signal(pids, sig) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=30)
        if self._group is not None:
            parent = self._group.parent / "cgroup.procs"
            for _ in range(50):  # members may fork while we move them out: until it is empty
                members = (self._group / "cgroup.procs").read_text().split()
                if not members:
                    break
                for pid in members:
                    try:
                        parent.write_text(pid)
                    except OSError:
                        pass
            self._group.rmdir()
