"""Run a command as a non-root user, for the tests (and the bench) that must prove the sandbox
works without root, as on a SLURM cluster where the job runs as the submitting user.

Not root already: the command runs as it is. Root: it runs as nobody (65534, or the uid asked for) with no capabilities,
in a private mount namespace where the interpreter's installation is made reachable (here it
lives under /root, which is 0700: a tmpfs is mounted over the blocking directory in that namespace
only, with the installation bound back at its own path). Nothing changes for the rest of the host.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

NOBODY = 65534
# RLIMIT_NPROC counts every task of a uid, and the weak sandbox mode's limit (16) is per uid:
# callers that may run at the same time (two xdist workers: the unprivileged make-run as nobody
# beside the sandbox cases) each take their own uid, or one's threads use up the other's forks.
# The sandbox cases take a fresh uid per case from SANDBOX_CASES_UID on (test_reward_unprivileged).
SANDBOX_TOOLS_UID = 64_981
SANDBOX_BENCH_UID = 64_982
SANDBOX_CASES_UID = 64_990  # the first of 64_990..64_999
REPO = Path(__file__).resolve().parents[3]


def _first_blocking_dir(path: str) -> str | None:
    """The outermost directory on the way to `path` that other users cannot traverse."""
    parts = Path(path).parts
    for i in range(2, len(parts) + 1):
        d = os.path.join(*parts[:i])
        if not os.stat(d).st_mode & 0o001:
            return d
    return None


def unprivileged_command(argv: list[str], uid: int = NOBODY) -> list[str]:
    """`argv` wrapped so that it runs as a non-root user (see the module docstring)."""
    if os.geteuid() != 0:
        return argv
    prefix = os.path.realpath(sys.base_prefix)
    script = "set -e\n"
    blocked = _first_blocking_dir(prefix)
    if blocked is not None:
        p, b = shlex.quote(prefix), shlex.quote(blocked)
        script += (
            f'keep=$(mktemp -d); mount --bind {p} "$keep"; mount -t tmpfs -o mode=755,size=1m tmpfs {b}\n'
            f'mkdir -p {p}; mount --move "$keep" {p}; rmdir "$keep"\n'
        )
    script += (
        f"exec setpriv --reuid={uid} --regid={uid} --clear-groups --inh-caps=-all "
        '--bounding-set=-all -- "$@"\n'
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]


def run_unprivileged(
    argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 300, uid: int = NOBODY
) -> subprocess.CompletedProcess:
    """Run `argv` (a python command line, usually) as a non-root user from the repository root."""
    blocked = _first_blocking_dir(str(REPO)) if os.geteuid() == 0 else None
    if blocked is not None:  # the user could not even import the project: say so, not ModuleNotFoundError
        raise RuntimeError(
            f"{blocked} is not searchable by other users (mode {oct(os.stat(blocked).st_mode & 0o777)}), so "
            f"the unprivileged user cannot reach the checkout {REPO}: clone it under a world-traversable "
            f"path, or `chmod o+x {blocked}` (a `mktemp -d` clone is 0700)"
        )
    base = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "LANG": "C.UTF-8",
    }
    return subprocess.run(
        unprivileged_command(argv, uid),
        env={**base, **(env or {})},
        cwd=REPO,
        capture_output=True,
        timeout=timeout_s,
        check=False,
    )
