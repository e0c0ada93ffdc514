"""Run one untrusted Python program in a fresh, locked-down subprocess and collect its output.

Contract of `run_program(files, stdin, limits) -> SandboxRun`:
- every call gets a fresh process, a fresh private work dir (deleted afterwards) and a scrubbed
  environment (PATH, HOME, TMPDIR, LANG only: no secrets, no proxy variables);
- the program is `main.py` from `files`, run as `python -I -S main.py` (standard library only);
- resource limits: CPU seconds, address space, processes, file size, open files (see SandboxLimits);
- the program never runs longer than `limits.wall_timeout_s`, counted from its exec (the boot's
  "R"), not from the sandbox's start: on a loaded machine the namespace and tmpfs setup alone can
  take seconds (CI: an infinite loop was killed before its exec at a 3 s limit and reported as a
  sandbox failure); the boot has its own bound, `_BOOT_TIMEOUT_S`. Afterwards the whole process group (and in
  the strong modes the whole PID namespace; in the weak mode as root every process of the
  worker's own sandbox uid) is SIGKILLed, so nothing it started survives the call;
- stdout and stderr are read up to `limits.max_output_bytes` together; past that the program is
  killed and `output_capped` is set;
- it never raises for anything the program does. `started=False` means the sandbox itself failed.

Isolation modes (`limits.isolation`, the `reward.network_isolation` config; sandbox_mode.py picks
and probes them, docs/sandbox.md compares them):
- netns (root) and userns (any user): new network (a downed loopback only), PID (the program sees
  only its own processes; when it exits the kernel kills everything it forked) and mount
  namespaces; the program's root is a size-capped tmpfs holding only its files, the interpreter
  and /usr (read-only), /dev/null & co and its own /proc: no host file, /tmp or /dev/shm.
  netns runs the program as the worker's claimed sandbox uid; userns as uid 0 of its own user
  namespace (the caller's uid outside) with every capability dropped.
- none (weak, explicit opt-in only): the same limits, uid drop (as root) and process-group kill,
  but no network isolation, and the host file system is visible with the program's rights.
The in-child setup lives in sandbox_boot.py; this module is the parent side.
"""

from __future__ import annotations

import ctypes
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from areal_jobs.config import NetworkIsolation, RewardConfig
from areal_jobs.reward.sandbox_mode import resolve_isolation, unshare_argv
from areal_jobs.reward.sandbox_uids import claimed_by_us, kill_uid

logger = logging.getLogger(__name__)

_BOOT_SCRIPT = str(Path(__file__).with_name("sandbox_boot.py"))
_PIPE_STDIN_MAX_BYTES = 60_000  # below the 64 KiB pipe buffer, so writing it never blocks
_EXIT_GRACE_S = 0.2  # after the program exits, how long leftover children may keep the pipes open
# How long the sandbox may take to exec the program (namespaces, tmpfs, uid drop): measured 0.1 s on
# an idle machine; past this the run is a sandbox failure saying so, never the program's timeout
_BOOT_TIMEOUT_S = 60.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Per-program limits. Defaults match RewardConfig's; tests shrink them."""

    cpu_s: int = 10
    memory_mb: int = 1024
    max_procs: int = 64
    max_file_mb: int = 16
    max_open_files: int = 64
    wall_timeout_s: float = 10.0
    max_output_bytes: int = 1 << 20
    tmpfs_mb: int = 64
    isolation: NetworkIsolation = NetworkIsolation.auto
    uid: int = RewardConfig.code_sandbox_uid  # programs run as this uid/gid when we are root (never 0 or -1)
    gid: int = 65534
    python: str = ""  # empty = the interpreter running this code

    @classmethod
    def from_config(cls, cfg: RewardConfig, uid: int | None = None) -> SandboxLimits:
        """Limits for a reward worker that claimed sandbox `uid` (sandbox_uids.py); None: the
        first uid of the range (for callers that run as non-root, where no uid is used)."""
        return cls(
            cpu_s=cfg.code_cpu_s,
            memory_mb=cfg.code_memory_mb,
            max_procs=cfg.code_max_procs,
            max_file_mb=cfg.code_max_file_mb,
            max_open_files=cfg.code_max_open_files,
            wall_timeout_s=cfg.code_wall_timeout_s,
            max_output_bytes=cfg.code_max_output_bytes,
            tmpfs_mb=cfg.code_tmpfs_mb,
            isolation=cfg.network_isolation,
            uid=cfg.code_sandbox_uid if uid is None else uid,
            gid=cfg.code_sandbox_gid,
            python=cfg.code_python,
        )


@dataclass(frozen=True, slots=True)
class SandboxRun:
    """What happened to one program. `stdout`/`stderr` are untrusted bytes: never log them."""

    started: bool  # False: the sandbox failed before the program ran (see `error`)
    returncode: int | None
    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False  # wall clock, or the CPU limit (SIGXCPU)
    output_capped: bool = False
    error: str = ""  # trusted, short: why the sandbox failed

    @property
    def exited_cleanly(self) -> bool:
        return self.started and not self.timed_out and not self.output_capped and self.returncode == 0


def _rlimits(limits: SandboxLimits) -> dict[str, tuple[int, int]]:
    mib = 1 << 20
    return {
        # Hard CPU limit one second above the soft one: SIGXCPU first, so we can tell a CPU timeout.
        "RLIMIT_CPU": (limits.cpu_s, limits.cpu_s + 1),
        "RLIMIT_AS": (limits.memory_mb * mib,) * 2,
        "RLIMIT_NPROC": (limits.max_procs,) * 2,
        "RLIMIT_FSIZE": (limits.max_file_mb * mib,) * 2,
        "RLIMIT_NOFILE": (limits.max_open_files,) * 2,
        "RLIMIT_CORE": (0, 0),
    }


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child after fork only calls it


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL the child (unshare or the boot script) if its parent worker dies."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def run_program(files: dict[str, str], stdin: bytes, limits: SandboxLimits) -> SandboxRun:
    """Run `files["main.py"]` (other files are placed beside it) with `stdin`. Never raises."""
    workdir = tempfile.mkdtemp(prefix="areal-sbx-")
    try:
        return _run_in(workdir, files, stdin, limits)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return SandboxRun(started=False, returncode=None, error=f"{type(e).__name__}: {e}"[:300])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_in(workdir: str, files: dict[str, str], stdin: bytes, limits: SandboxLimits) -> SandboxRun:
    if os.geteuid() == 0 and (limits.uid <= 0 or limits.gid <= 0):
        # Root can signal every process, write every file and remount anything, namespaces or
        # not: untrusted code never keeps it.
        raise RuntimeError(
            "refusing to run untrusted code as root: set reward.code_sandbox_uid to an unprivileged uid"
        )
    mode = resolve_isolation(limits.isolation)
    namespaces = mode is not NetworkIsolation.none
    as_root = os.geteuid() == 0
    # netns copies the files into a tmpfs it owns; otherwise the boot script reads them as the
    # sandbox uid (none: after its uid drop; userns as root: unshare already runs as that uid).
    chown = as_root and mode is not NetworkIsolation.netns
    for name, text in files.items():
        Path(workdir, name).write_text(text)
        if chown:
            os.chown(Path(workdir, name), limits.uid, limits.gid)
    if chown:
        os.chown(workdir, limits.uid, limits.gid)
    # Who drops to the sandbox uid: the boot script (netns, none as root), or Popen before unshare
    # (userns as root: a user namespace made by root would map root itself).
    boot_drops_uid = as_root and mode is not NetworkIsolation.userns
    popen_user = {}
    if as_root and mode is NetworkIsolation.userns:
        popen_user = {"user": limits.uid, "group": limits.gid, "extra_groups": []}

    ready_r, ready_w = os.pipe()
    spec = {
        "workdir": workdir,
        "script": "main.py",
        "uid": limits.uid if boot_drops_uid else -1,
        "gid": limits.gid if boot_drops_uid else -1,
        "isolate_fs": int(namespaces),
        "drop_caps": int(mode is NetworkIsolation.userns),
        "tmpfs_mb": limits.tmpfs_mb,
        "ready_fd": ready_w,
        **{f"rlimit.{name}": f"{soft},{hard}" for name, (soft, hard) in _rlimits(limits).items()},
    }
    python = limits.python or os.path.realpath(sys.executable)
    argv = [python, "-I", "-S", _BOOT_SCRIPT, *(f"{key}={value}" for key, value in spec.items())]
    argv = [*unshare_argv(mode), *argv]
    home = "/work" if namespaces else workdir  # namespace mode: the program's chroot path
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}
    stdin_file = _stdin_source(stdin)
    try:
        proc = subprocess.Popen(
            argv,
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=workdir,
            start_new_session=True,  # its own process group, killed as a whole below
            pass_fds=(ready_w,),
            # Reward workers are single-threaded, the case where preexec_fn is safe.
            preexec_fn=_die_with_parent,  # noqa: PLW1509  (runs after Popen's uid change)
            **popen_user,
        )
    finally:
        os.close(ready_w)
        os.close(stdin_file)
    try:
        stdout, stderr, timed_out, capped, report = _collect(proc, limits, ready_r)
    finally:
        _kill_group(proc)
        if boot_drops_uid and not namespaces and claimed_by_us(limits.uid):
            # Weak mode as root: a double-forked setsid daemon left the process group, but not
            # its uid, which this worker claimed for itself alone (sandbox_uids.py).
            kill_uid(limits.uid)
        os.set_blocking(ready_r, False)  # whoever held the write end is dead; never wait here
        try:
            report += os.read(ready_r, 64)
        except BlockingIOError:
            pass
        os.close(ready_r)
    # The boot script sends "R" just before exec and "X" if the exec failed; in namespace mode its
    # init then adds "W<wait status>" of the program.
    started = report.startswith(b"R") and not report.startswith(b"RX")
    returncode = proc.returncode
    status = report.partition(b"W")[2]
    if started and status.isdigit():
        returncode = os.waitstatus_to_exitcode(int(status))
    timed_out = timed_out or returncode == -signal.SIGXCPU
    if not started:
        reason = stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {returncode}"]
        if timed_out:  # killed by the boot bound, not by the program's own wall clock
            reason = [
                f"the sandbox did not start the program within {_BOOT_TIMEOUT_S:g}s (an overloaded machine?)"
            ]
        return SandboxRun(started=False, returncode=returncode, error=reason[0][:300])
    return SandboxRun(True, returncode, stdout, stderr, timed_out, capped)


def _stdin_source(data: bytes) -> int:
    """An fd the program reads as stdin. Small inputs go through a pipe, so once read they are
    gone (the HumanEval harness passes its nonce this way); big ones through an unlinked file."""
    if len(data) <= _PIPE_STDIN_MAX_BYTES:
        r, w = os.pipe()
        os.write(w, data)
        os.close(w)
        return r
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        os.lseek(f.fileno(), 0, os.SEEK_SET)
        return os.dup(f.fileno())


def _collect(
    proc: subprocess.Popen, limits: SandboxLimits, ready_r: int
) -> tuple[bytes, bytes, bool, bool, bytes]:
    """Read stdout/stderr until both close, the wall clock runs out, or the output cap is hit; and
    the boot's report from `ready_r`, whose "R" (the program's exec) starts the wall clock."""
    assert proc.stdout is not None and proc.stderr is not None
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    report = bytearray()
    deadline = time.monotonic() + _BOOT_TIMEOUT_S
    exited_at: float | None = None
    timed_out = capped = False
    with selectors.DefaultSelector() as sel:
        for fd in (*bufs, ready_r):
            sel.register(fd, selectors.EVENT_READ)
        while any(fd in sel.get_map() for fd in bufs) and not capped:
            now = time.monotonic()
            if exited_at is None and _exited(proc.pid):
                exited_at = now
            if exited_at is not None and now - exited_at > _EXIT_GRACE_S:
                break  # the program is gone; a leftover child holds the pipes: stop waiting for it
            if now >= deadline:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(deadline - now, 0.05 if exited_at else 0.5)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                if key.fd == ready_r:
                    if not report and chunk.startswith(b"R"):
                        deadline = time.monotonic() + limits.wall_timeout_s  # the program runs
                    report += chunk
                    continue
                bufs[key.fd] += chunk
                if sum(len(b) for b in bufs.values()) > limits.max_output_bytes:
                    capped = True
                    break
    return (
        bytes(bufs[proc.stdout.fileno()]),
        bytes(bufs[proc.stderr.fileno()]),
        timed_out,
        capped,
        bytes(report),
    )


def _exited(pid: int) -> bool:
    """Has the child exited? Unlike Popen.poll this leaves the zombie unreaped, so its pid (our
    process-group id) cannot be reused before _kill_group signals the group."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the program's process group (in namespace mode that takes its PID namespace down
    with it) and reap the direct child. The group id is the child's pid (start_new_session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        logger.error("sandbox child %d did not die after SIGKILL", proc.pid)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
