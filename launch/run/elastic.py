"""launch.local's rollout servers as a set that heals itself and can grow or shrink mid-run.

`python -m launch.scale RUN_DIR +N|-N|N` (`make scale RUN=... SERVERS=+1`) writes
RUN_DIR/scale.json = {"num_servers": target}; `ServerSet.poll` (once a second, from launch.run.local):
- a server that died is started again under its index (at most rollout.max_server_restarts
  times), and rejoins with the current weights, as before;
- target above the servers running: new ones start under fresh indices; the controller admits
  each once it has registered, and it takes work after the next weight update gave it the
  current weights (the broadcast groups are re-formed with it);
- target below: the highest indices get a drain marker; the controller sends them nothing new and
  answers <index>.drained once none of their requests is in flight; only then is the process
  stopped (by its PID) and its registration removed, so no request is lost.
"""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from areal_jobs.atomic import write_atomic
from areal_jobs.transport import discovery

logger = logging.getLogger("launch.local")

SCALE_FILE = "scale.json"


class ServerRole(Protocol):
    name: str
    process: subprocess.Popen
    log: Path
    restarts: int


def read_target(run_dir: Path) -> int | None:
    """The number of servers asked for by launch.scale, or None (none asked)."""
    path = Path(run_dir) / SCALE_FILE
    if not path.exists():
        return None
    try:
        return int(json.loads(path.read_text())["num_servers"])
    except (OSError, ValueError, KeyError, TypeError):
        logger.warning('ignoring %s: not {"num_servers": N}', path)
        return None


def write_target(run_dir: Path, num_servers: int) -> None:
    if num_servers < 1:
        raise ValueError(f"a run needs at least one rollout server (asked for {num_servers})")
    write_atomic(Path(run_dir) / SCALE_FILE, json.dumps({"num_servers": num_servers}))


class ServerSet:
    def __init__(
        self,
        run_dir: Path,
        start: Callable[[int], ServerRole],
        stop: Callable[[list[ServerRole]], None],
        max_restarts: int,
        num_servers: int,
        scalable: bool = True,
    ) -> None:
        """`scalable=False`: a fixed set that only heals (the reward-model servers: launch.scale
        sizes the rollout servers)."""
        self.run_dir = run_dir
        self.scalable = scalable
        self.start = start
        self.stop = stop
        self.max_restarts = max_restarts
        self.servers: dict[int, ServerRole] = {i: start(i) for i in range(num_servers)}
        self.draining: set[int] = set()
        self._next_index = num_servers  # an index is never reused within a run

    @property
    def roles(self) -> list[ServerRole]:
        return [self.servers[i] for i in sorted(self.servers)]

    @property
    def serving(self) -> list[int]:
        return sorted(i for i in self.servers if i not in self.draining)

    def poll(self) -> tuple[str | None, bool]:
        """(why the run must fail, or None; whether the set of processes changed)."""
        changed = False
        for index, role in list(self.servers.items()):
            code = role.process.poll()
            if index in self.draining:
                if discovery.is_drained(self.run_dir, index) or code is not None:
                    self._release(index, role)
                    changed = True
                continue
            if code is None:
                continue
            if role.restarts >= self.max_restarts:
                return (
                    f"{role.name} died {role.restarts + 1} times (last code {code}); see {role.log}",
                    changed,
                )
            logger.warning(
                "%s exited with code %s; restarting it (%d/%d)",
                role.name,
                code,
                role.restarts + 1,
                self.max_restarts,
            )
            fresh = self.start(index)
            fresh.restarts = role.restarts + 1
            self.servers[index] = fresh
            changed = True
        return None, self._scale() or changed

    def _scale(self) -> bool:
        if not self.scalable:
            return False
        target = read_target(self.run_dir)
        serving = self.serving
        if target is None or target == len(serving):
            return False
        if target > len(serving):
            for _ in range(target - len(serving)):
                index, self._next_index = self._next_index, self._next_index + 1
                self.servers[index] = self.start(index)
                logger.info("server %d added (launch.scale: %d servers)", index, target)
            return True
        for index in serving[target - len(serving) :]:
            discovery.request_drain(self.run_dir, index)
            self.draining.add(index)
            logger.info(
                "server %d draining (launch.scale: %d servers): it gets no new request", index, target
            )
        return False

    def _release(self, index: int, role: ServerRole) -> None:
        self.stop([role])
        discovery.unregister_server(self.run_dir, index)
        del self.servers[index]
        self.draining.discard(index)
        logger.info("server %d released: none of its requests was in flight", index)
