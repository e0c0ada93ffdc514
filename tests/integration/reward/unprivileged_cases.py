"""Escape attempts and service checks, run as a NON-ROOT user by test_reward_unprivileged.py
(`python unprivileged_cases.py <case> <mode> [args]`); prints one JSON object on its last line.

Each attack leaves a witness the host can see if it escaped: a process whose command line holds a
unique number (found by scanning /proc), a file, an accepted TCP connection. The same attack runs
in the weak mode as the control: there the witnesses appear, so the checks can fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time

from areal_jobs.api import RewardRequest
from areal_jobs.config import NetworkIsolation, RewardConfig
from areal_jobs.reward.sandbox import SandboxLimits, run_program
from areal_jobs.reward.service import RewardService

LIMITS = {"cpu_s": 2, "wall_timeout_s": 4.0, "memory_mb": 512, "max_procs": 16}

# Double fork + setsid: the daemon leaves the process group. Its child execs `sleep <tag>` (the
# host looks for that command line), and the daemon writes a host file 3 s later.
DAEMON = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        if os.fork() == 0:
            os.execv("/bin/sleep", ["sleep", "{tag}"])
        time.sleep(3)
        try:
            open("{marker}", "w").write("escaped")
        except OSError:
            pass
        os._exit(0)
    os._exit(0)
print("forked")
"""

LISTENER = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", {port}))
except OSError:
    s.bind(("0.0.0.0", {port}))
s.listen(8)
s.settimeout(2.5)
print("listening")
try:
    s.accept()
    print("accepted")
except OSError:
    print("no connection")
"""

LEAVE_FILES = """
import os
out = []
for path in ("/dev/shm/{name}", "/tmp/{name}"):
    try:
        with open(path, "wb") as f:
            f.write(b"x" * (16 << 20 if "shm" in path else 1 << 20))
        out.append("wrote " + path)
    except OSError as e:
        out.append(type(e).__name__)
print(out)
"""

READ_SECRETS = """
import os
found = [k for k, v in os.environ.items() if "{secret}" in v]
for pid in os.listdir("/proc"):
    try:
        if b"{secret}" in open("/proc/%s/environ" % pid, "rb").read():
            found.append("pid " + pid)
    except OSError:
        pass
print(found, len([p for p in os.listdir("/proc") if p.isdigit()]))
"""


def witness_of(tag: str) -> str:
    """The command-line tag of a witness process: never a substring of our own command line."""
    return f"{tag}99"


def processes_with(tag: str) -> list[int]:
    """Pids whose command line contains `tag` (zombies and vanished processes skipped)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and tag.encode() in open(f"/proc/{entry}/cmdline", "rb").read():
                found.append(int(entry))
        except OSError:
            continue
    return found


def escapes(mode: NetworkIsolation, marker_dir: str, port: int, tag: str) -> dict:
    limits = SandboxLimits(isolation=mode, **LIMITS)
    out: dict = {"uid": os.getuid()}
    marker = os.path.join(marker_dir, f"daemon-{mode.value}")
    witness = witness_of(tag)
    run = run_program({"main.py": DAEMON.format(tag=witness, marker=marker)}, b"", limits)
    out["daemon_run"] = [run.started, run.stdout.decode()]
    # how it ended, for the assertion's message: exit status, the wall clock, its last error lines
    out["daemon_end"] = [run.returncode, run.timed_out, run.stderr.decode(errors="replace")[-600:]]
    # The listener, with the host knocking on its port for the whole run.
    connected, done = [], threading.Event()

    def knock() -> None:
        while not done.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    connected.append(True)
            except OSError:
                pass
            time.sleep(0.05)

    knocker = threading.Thread(target=knock)
    knocker.start()
    run = run_program({"main.py": LISTENER.format(port=port)}, b"", limits)
    done.set()
    knocker.join()
    out["listener"] = run.stdout.decode().split()
    out["host_connected"] = bool(connected)
    name = f"areal-leak-{tag}-{mode.value}"
    run = run_program({"main.py": LEAVE_FILES.format(name=name)}, b"", limits)
    out["leave_files_run"] = run.stdout.decode().strip()
    out["host_files_left"] = [p for p in (f"/dev/shm/{name}", f"/tmp/{name}") if os.path.exists(p)]
    secret = os.environ["AREAL_TEST_SECRET"]  # in this (the parent's) initial environment only
    run = run_program({"main.py": READ_SECRETS.format(secret=secret)}, b"", limits)
    out["secrets_run"] = run.stdout.decode().strip()
    time.sleep(6.0)  # the daemon writes its marker 3 s after the run; look well after that
    out["daemon_processes"] = processes_with(witness)
    out["daemon_marker"] = os.path.exists(marker)
    return out


# Takes every process slot it can, each held by a `sleep <tag>`, then waits.
BOMB = """
import os, time
n = 0
while n < 10000:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.execv("/bin/sleep", ["sleep", "{tag}"])
    n += 1
print(n)
time.sleep(6)
"""
# Needs one fork: a starved process budget makes it fail.
FORKS_ONCE = "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\nprint(input())\n"


def fork_bomb(mode: NetworkIsolation, tag: str) -> dict:
    """Service A runs a fork bomb; while it holds its slots, service B scores a program that forks."""
    cfg = RewardConfig(
        num_workers=1, timeout_s=30.0, network_isolation=mode, code_wall_timeout_s=8.0, code_cpu_s=4,
        code_max_procs=16, code_memory_mb=512,
    )  # fmt: skip
    a, b = RewardService(cfg), RewardService(cfg)
    a.start()
    b.start()
    try:
        ref = json.dumps({"tests": [{"input": "7\n", "output": "7\n"}]})
        holder: dict = {}
        witness = witness_of(tag)
        thread = threading.Thread(
            target=lambda: holder.update(
                a=asyncio.run(a.score_group([RewardRequest("code_stdio", BOMB.format(tag=witness), ref)]))
            )
        )
        thread.start()
        deadline = time.monotonic() + 20
        while len(processes_with(witness)) < 8 and time.monotonic() < deadline:  # the bomb is holding
            time.sleep(0.05)
        held = len(processes_with(witness))
        result = asyncio.run(b.score_group([RewardRequest("code_stdio", FORKS_ONCE, ref)]))[0]
        thread.join()
    finally:
        a.close()
        b.close()
    return {
        "held_slots": held,
        "b_reward": result.reward,
        "b_status": result.status.value,
        "b_detail": result.detail,
    }


def start_service(mode: NetworkIsolation) -> dict:
    """Start a service in `mode`: the mode in force and a score, or the start-up error."""
    service = RewardService(RewardConfig(num_workers=1, network_isolation=mode))
    try:
        service.start()
    except RuntimeError as e:
        return {"error": str(e)}
    try:
        ref = json.dumps({"tests": [{"input": "7\n", "output": "7\n"}]})
        result = asyncio.run(service.score_group([RewardRequest("code_stdio", "print(input())", ref)]))[0]
        return {"mode": service.isolation.value, "reward": result.reward, "metrics": service.metrics()}
    finally:
        service.close()


def main() -> None:
    case, mode = sys.argv[1], NetworkIsolation(sys.argv[2])
    if case == "escapes":
        out = escapes(mode, sys.argv[3], int(sys.argv[4]), sys.argv[5])
    elif case == "fork_bomb":
        out = fork_bomb(mode, sys.argv[3])
    else:
        if sys.argv[3:] == ["no-unshare"]:  # namespaces made unavailable: no unshare(1) on PATH
            os.environ["PATH"] = "/nonexistent"
        out = start_service(mode)
    out["uid"] = os.getuid()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
