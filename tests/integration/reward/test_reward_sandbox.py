"""The sandbox on real subprocesses: output, limits, scrubbed environment, isolation, failures."""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import glob
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from areal_jobs.config import NetworkIsolation, RewardConfig
from areal_jobs.reward import sandbox, sandbox_mode
from areal_jobs.reward.sandbox import SandboxLimits, run_program

LIMITS = SandboxLimits(cpu_s=2, wall_timeout_s=3.0, memory_mb=512, max_procs=16, max_output_bytes=1 << 16)


def run(source: str, stdin: bytes = b"", limits: SandboxLimits = LIMITS) -> sandbox.SandboxRun:
    return run_program({"main.py": source}, stdin, limits)


def test_program_reads_stdin_and_writes_stdout() -> None:
    result = run("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", b"1 2 3\n")
    assert result.exited_cleanly
    assert result.stdout == b"6\n"


def test_exit_status_and_stderr_are_reported() -> None:
    result = run("import sys\nsys.stderr.write('boom')\nsys.exit(3)")
    assert result.started and result.returncode == 3 and result.stderr == b"boom"
    assert not result.exited_cleanly


def test_large_stdin_is_delivered_whole() -> None:
    data = b"x" * 300_000  # beyond a pipe buffer: goes through an unlinked file
    result = run("import sys\nprint(len(sys.stdin.buffer.read()))", data)
    assert result.stdout == b"300000\n"


def test_environment_is_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AREAL_PLANTED_SECRET", "hunter2")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    result = run("import os\nprint(sorted(os.environ))")
    assert result.stdout == b"['HOME', 'LANG', 'PATH', 'TMPDIR']\n"


def _host_work_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "areal-sbx-*")))


def test_work_dir_is_private_writable_and_removed(namespaces: bool) -> None:
    before = _host_work_dirs()
    source = "import os\nopen('scratch.txt', 'w').write('x' * 1000)\nprint(os.getcwd())\nprint(oct(os.stat('.').st_mode & 0o777))"
    result = run(source)
    assert result.exited_cleanly
    workdir, mode = result.stdout.decode().split()
    if namespaces:
        assert workdir == "/work"  # inside its chroot
    else:
        assert workdir.startswith(os.path.join(tempfile.gettempdir(), "areal-sbx-"))
    assert mode == "0o700"
    assert _host_work_dirs() <= before  # removed after the call


def test_wall_clock_timeout_kills_a_sleeper(leftover_sandbox_processes) -> None:
    result = run("import os, time\nos.fork()\ntime.sleep(60)")
    assert result.started and result.timed_out and not result.exited_cleanly
    assert leftover_sandbox_processes() == []


def test_cpu_limit_stops_a_busy_loop() -> None:
    result = run("while True:\n    pass", limits=SandboxLimits(cpu_s=1, wall_timeout_s=20.0))
    assert result.timed_out
    assert result.returncode == -signal.SIGXCPU  # the CPU limit fired, not the 20 s wall clock


def test_output_is_capped() -> None:
    result = run("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)")
    assert result.output_capped and not result.timed_out
    assert len(result.stdout) <= LIMITS.max_output_bytes + (1 << 16)


def test_memory_limit() -> None:
    result = run("x = bytearray(2 * 1024**3)\nprint('allocated')")
    assert result.started and result.returncode != 0 and b"MemoryError" in result.stderr


def test_file_size_limit() -> None:
    result = run("open('big', 'wb').write(b'z' * (64 * 1024 * 1024))\nprint('wrote')", limits=LIMITS)
    assert result.returncode != 0 and b"wrote" not in result.stdout


def test_sandbox_failure_is_not_a_program_failure() -> None:
    result = run("print(1)", limits=SandboxLimits(python="/nonexistent/python3"))
    assert not result.started
    assert result.error


@pytest.mark.skipif(os.geteuid() != 0, reason="only root has privileges to keep")
@pytest.mark.parametrize("uid", [-1, 0])
def test_root_never_runs_untrusted_code_as_root(uid: int, tmp_path) -> None:
    marker = tmp_path / "ran"
    result = run(f"open({str(marker)!r}, 'w')", limits=SandboxLimits(uid=uid))
    assert not result.started and "refusing" in result.error
    assert not marker.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to the sandbox uid needs root")
def test_program_runs_as_the_unprivileged_sandbox_uid() -> None:
    result = run("import os\nprint(os.getuid(), os.getgid(), os.getgroups())")
    assert result.stdout == f"{LIMITS.uid} 65534 []\n".encode()
    assert LIMITS.uid == RewardConfig().code_sandbox_uid


# Holds every process slot its uid may have (children sleep), then exits.
_SLOT_HOG = (
    "import os, time\n"
    "for _ in range(64):\n"
    "    try:\n"
    "        if os.fork() == 0:\n"
    "            time.sleep(5)\n"
    "            os._exit(0)\n"
    "    except OSError:\n"
    "        break\n"
    "time.sleep(5)\n"
)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to the sandbox uid needs root")
def test_a_fork_bomb_does_not_starve_the_next_workers_sandbox() -> None:
    """RLIMIT_NPROC counts all processes of a uid: reward workers each get their own uid, so
    a program holding every slot of its uid leaves the sandbox of the worker beside it alone."""
    cfg = RewardConfig(num_workers=2)
    hog_limits = dataclasses.replace(LIMITS, max_procs=8, wall_timeout_s=8.0, uid=cfg.code_sandbox_uid)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        hog = pool.submit(run, _SLOT_HOG, b"", hog_limits)
        time.sleep(2.0)  # the hog forks its 8 processes within milliseconds
        # exec fails once a uid has more processes than the caller's limit (strictly more: a
        # program at exactly its limit may still exec), hence the smaller limit for the runs.
        small = dataclasses.replace(LIMITS, max_procs=4)
        same_uid = run("print('ran')", limits=small)
        next_worker = run("print('ran')", limits=dataclasses.replace(small, uid=cfg.code_sandbox_uid + 1))
        assert hog.result(timeout=30).started
    # The control: under the hog's uid, exec hits the limit (so this test can fail).
    assert not same_uid.started and "Resource temporarily unavailable" in same_uid.error, same_uid
    assert next_worker.exited_cleanly and next_worker.stdout == b"ran\n", next_worker


def test_namespace_isolation(namespaces: bool) -> None:
    if not namespaces:
        pytest.skip(f"namespaces unavailable: {sandbox_mode.unavailable_reason(NetworkIsolation.netns)}")
    source = (
        "import os, socket\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "print([name for _, name in socket.if_nameindex()])\n"
        "try:\n    open('/usr/areal_probe', 'w')\nexcept OSError as e:\n    print(e.errno)\n"
        "print(sorted(os.listdir('/')))\n"
        f"print([os.path.exists(p) for p in ('/etc/passwd', '/home', {str(Path(__file__).parent)!r})])\n"
        "open('/dev/null', 'w').write('discarded')\n"
        "print(len(open('/dev/urandom', 'rb').read(8)))\n"
    )
    result = run(source)
    assert result.exited_cleanly, result.stderr[-300:]
    lines = result.stdout.decode().splitlines()
    assert lines[0] == "[1, 2]"  # the namespace's init and the program: nothing of the host
    assert lines[1] == "['lo']"
    assert lines[2] in ("13", "30")  # EACCES (not root) or EROFS (read-only remount)
    assert set(ast.literal_eval(lines[3])) <= {
        "work",
        "tmp",
        "dev",
        "proc",
        "usr",
        "bin",
        "lib",
        "lib64",
        "lib32",
        "sbin",
        "root",
        "opt",
        "home",
    }
    assert lines[4] == "[False, False, False]"  # no host file outside /usr and the interpreter is visible
    assert lines[5] == "8"


def _world_executable(path: str) -> bool:
    """Can any uid run `path`? (every directory on the way o+x, the file o+x)"""
    path = os.path.realpath(path)
    parts = [path] + [os.path.dirname(path)]
    while parts[-1] != "/":
        parts.append(os.path.dirname(parts[-1]))
    return os.path.exists(path) and all(os.stat(p).st_mode & 0o001 for p in parts)


def test_no_silent_downgrade_when_namespaces_are_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_mode, "unavailable_reason", lambda mode: "no CAP_SYS_ADMIN (simulated)")
    required = run("print(1)", limits=SandboxLimits(isolation=NetworkIsolation.netns))
    assert not required.started and "reward.network_isolation=netns" in required.error
    refused = run("print(1)", limits=SandboxLimits(isolation=NetworkIsolation.auto))
    assert not refused.started and "reward.network_isolation=none" in refused.error  # names the override
    # The explicit weak mode runs; the sandbox uid must reach the interpreter itself (no bind mount).
    python = next((p for p in (sys.executable, "/usr/bin/python3") if _world_executable(p)), None)
    if python is None:
        pytest.skip("no interpreter here that the sandbox uid can execute without a bind mount")
    weak = run("print(1)", limits=SandboxLimits(isolation=NetworkIsolation.none, python=python))
    assert weak.exited_cleanly and weak.stdout == b"1\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop needs root")
def test_weak_mode_reports_an_unreachable_interpreter(tmp_path) -> None:
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    python = hidden / "python3"
    python.symlink_to(os.path.realpath(sys.executable))
    result = run("print(1)", limits=SandboxLimits(python=str(python), isolation=NetworkIsolation.none))
    assert not result.started and "reward.code_python" in result.error


def test_a_private_umask_of_the_run_does_not_lock_the_sandbox_out(namespaces: bool) -> None:
    """launch.local and the SLURM job run under umask 077 (issue 28: the run directory is private);
    the root the boot script builds must still be traversable by the program (the interpreter's
    installation is bound below directories the boot creates)."""
    previous = os.umask(0o077)
    try:
        result = run("print('ok')")
    finally:
        os.umask(previous)
    assert result.exited_cleanly and result.stdout == b"ok\n", result


def _slow_boot(monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:
    """The real boot script, started `delay_s` late: a loaded machine's namespace and tmpfs setup."""
    folder = Path(tempfile.mkdtemp(prefix="slow-boot-"))
    folder.chmod(0o755)  # the userns mode starts the boot as the sandbox uid
    script = folder / "slow_boot.py"
    script.write_text(
        f"import runpy, sys, time\ntime.sleep({delay_s})\nsys.argv[0] = {sandbox._BOOT_SCRIPT!r}\n"
        f"runpy.run_path({sandbox._BOOT_SCRIPT!r}, run_name='__main__')\n"
    )
    script.chmod(0o644)
    monkeypatch.setattr(sandbox, "_BOOT_SCRIPT", str(script))


def test_the_wall_clock_starts_when_the_program_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """CI, on a loaded machine: an infinite loop was killed before its exec at a 3 s limit and
    reported as a sandbox failure. A boot slower than the program's whole limit costs it nothing."""
    _slow_boot(monkeypatch, 2.0)
    limits = dataclasses.replace(LIMITS, wall_timeout_s=1.0)
    quick = run("print('ok')", limits=limits)
    assert quick.exited_cleanly and quick.stdout == b"ok\n", quick
    loop = run("while True:\n    pass", limits=limits)
    assert loop.started and loop.timed_out, loop


def test_a_boot_past_its_own_bound_is_a_sandbox_failure_that_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_boot(monkeypatch, 3.0)
    monkeypatch.setattr(sandbox, "_BOOT_TIMEOUT_S", 0.5)
    result = run("print('ok')")
    assert not result.started and "did not start the program within 0.5s" in result.error, result
