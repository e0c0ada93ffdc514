"""One rollout server under a restart policy, as the SLURM job runs each server task:

    python -m areal_jobs.rollout.supervise --config RUN_DIR/config.yaml --index I [--reward]

(`--reward`: a reward-model server, areal_jobs/rollout/reward_server.py, under the same policy.)

A server that dies (an OOM, an engine crash, kill -9) is started again in place after a backoff
(1, 2, 4, ... 30 s), at most rollout.max_server_restarts times, and rejoins the pool with the
current weights, exactly like a server the local launcher restarts. SIGTERM (the job stopping its
servers) is passed to the server, which shuts down; the supervisor then exits 0. Once the budget is
spent it exits with the server's code: the other servers of the step run on (the step is started
with --kill-on-bad-exit=0) and the controller goes on with fewer. Only when every server of the
step has given up does the job stop (sbatch/hetjob.sbatch.tmpl).
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from areal_jobs.config import load_job_config
from areal_jobs.logs import setup_logging

logger = logging.getLogger("areal_jobs.rollout.supervise")  # not __name__: "__main__" under -m

MAX_BACKOFF_S = 30.0


def backoff_s(restart: int) -> float:
    """Seconds before restart number `restart` (1-based): 1, 2, 4, ..., at most 30."""
    return min(2.0 ** (restart - 1), MAX_BACKOFF_S)


class Supervisor:
    def __init__(self, command: list[str], max_restarts: int, sleep: Callable[[float], None] = time.sleep):
        self.command = command
        self.max_restarts = max_restarts
        self.sleep = sleep
        self.child: subprocess.Popen | None = None
        self.stopping = False
        self.restarts = 0

    def on_sigterm(self, signum, frame) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def run(self) -> int:
        """The server's exit code once it stopped for good (0 after SIGTERM)."""
        while True:
            self.child = subprocess.Popen(self.command)
            code = self.child.wait()
            if self.stopping or code == 0:
                logger.info("server stopped (code %d)", code)
                return 0
            if self.restarts >= self.max_restarts:
                logger.error(
                    "server exited with code %d; restart budget spent (%d, rollout.max_server_restarts): "
                    "giving up, the other servers go on", code, self.max_restarts,
                )  # fmt: skip
                return code
            self.restarts += 1
            wait_s = backoff_s(self.restarts)
            logger.warning(
                "server exited with code %d; restart %d/%d in %.0f s",
                code, self.restarts, self.max_restarts, wait_s,
            )  # fmt: skip
            self.sleep(wait_s)
            if self.stopping:  # asked to stop during the backoff
                return 0


def server_command(config: str, index: int, reward: bool = False) -> list[str]:
    """`reward`: a reward-model server (reward_server.py), supervised the same way."""
    module = "areal_jobs.rollout.reward_server" if reward else "areal_jobs.rollout.server"
    return [sys.executable, "-m", module, "--config", config, "--index", str(index)]


def main(argv: list[str] | None = None, command: list[str] | None = None) -> int:
    """`command`: what to supervise instead of the real server (the SLURM tests' stand-in)."""
    parser = argparse.ArgumentParser(prog="python -m areal_jobs.rollout.supervise")
    parser.add_argument("--config", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--reward", action="store_true", help="a reward-model server (reward.model.*)")
    args = parser.parse_args(argv)
    cfg = load_job_config(args.config)
    setup_logging(f"supervise{args.index}")
    supervisor = Supervisor(
        command or server_command(args.config, args.index, args.reward), cfg.rollout.max_server_restarts
    )
    signal.signal(signal.SIGTERM, supervisor.on_sigterm)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
