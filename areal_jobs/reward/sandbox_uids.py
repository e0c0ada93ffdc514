"""Per-worker sandbox uids when the reward service runs as root (netns and none modes).

Each worker claims one uid of [first_uid, first_uid + count) by taking an exclusive flock on
`<lock_dir>/<uid>.lock`, held by an open file descriptor for the worker's whole life; the kernel
drops it when the worker dies, however it dies, so no lease can go stale. Every reward service on
a host (this job's other workers, another job, another user's job run as root) uses the same lock
directory, so no two live workers ever share a uid: RLIMIT_NPROC, which counts all processes of a
uid, is then a budget per worker, and no program can signal another worker's programs.

A uid that still has processes (a leftover of a weak-mode run whose worker died) is skipped.
In userns mode as non-root there is no uid to claim: each run has its own user namespace, whose
process count (RLIMIT_NPROC is accounted per user namespace) and PID namespace are its own.
"""

from __future__ import annotations

import fcntl
import os

_claimed: dict[int, int] = {}  # uid -> its lock fd, held for the life of this process


def claimed_by_us(uid: int) -> bool:
    """Did this process claim `uid`? Only then are all of its processes ours to kill."""
    return uid in _claimed


def uids_with_processes() -> set[int]:
    """Real uids of the live processes on this host (those that vanish meanwhile are skipped)."""
    uids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                uids.add(os.stat(f"/proc/{entry}").st_uid)
            except OSError:
                continue
    return uids


def claim_sandbox_uid(first_uid: int, count: int, lock_dir: str) -> int:
    """Claim a free uid for this process until it exits. Raises RuntimeError when none is free."""
    os.makedirs(lock_dir, mode=0o755, exist_ok=True)
    busy = uids_with_processes()
    for uid in range(first_uid, first_uid + count):
        if uid in busy:
            continue
        fd = os.open(os.path.join(lock_dir, f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _claimed[uid] = fd
        return uid
    raise RuntimeError(
        f"all {count} sandbox uids from reward.code_sandbox_uid={first_uid} are taken (locks in "
        f"{lock_dir}): raise reward.code_sandbox_uid_count"
    )


def kill_uid(uid: int) -> int:
    """SIGKILL every process of `uid` (root only; call only for a uid claimed_by_us). Returns how many."""
    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid == uid:
                os.kill(int(entry), 9)
                killed += 1
        except OSError:
            continue
    return killed
