"""The `python` tool (agent/tools.py) in the real reward sandbox, through a real RewardService: a
program that hangs is cut off at the tool timeout and reported, one that floods output is cut at
the output cap and reported, an exception comes back as its last traceback line, and all of it
works as a non-root user too (userns), as on a SLURM cluster. Every case checks that nothing the
program started outlives the call."""

from __future__ import annotations

import json
import sys

import pytest
from unprivileged import SANDBOX_TOOLS_UID, run_unprivileged

from areal_jobs.agent.tools import Toolbox

TIMEOUT_S = 1.0  # the tool's own limit: below the sandbox's (3 s) and the service's (20 s)
PATIENT_TIMEOUT_S = 30.0  # programs that end by themselves (the sandbox's 3 s wall clock still applies)
OUTPUT_CHARS = 64


def caller(scorer, timeout_s: float):
    box = Toolbox(scorer.service, timeout_s, OUTPUT_CHARS)
    return lambda name, arguments: scorer.loop.run_until_complete(box.call(name, arguments))


@pytest.fixture(scope="module")
def call(scorer):
    """Programs that end by themselves: a wall clock no loaded machine reaches (a sandboxed
    interpreter's start took over 1 s beside the rest of the suite: "timed out after 1s")."""
    return caller(scorer, PATIENT_TIMEOUT_S)


@pytest.fixture(scope="module")
def call_1s(scorer):
    """Programs that never end: cut off at TIMEOUT_S."""
    return caller(scorer, TIMEOUT_S)


def test_a_program_runs_and_its_last_expression_is_printed(call, namespaces) -> None:
    assert call("python", "print(6 * 7)") == "42"
    assert call("python", "x = 2\nx ** 10") == "1024"
    assert call("python", "x = 1") == "(no output)"
    if namespaces:  # in its own PID namespace, under its init: the reward sandbox, not the worker
        assert call("python", "import os\nos.getpid()") == "2"


def test_a_hanging_program_is_cut_off_and_reported(call_1s, leftover_sandbox_processes) -> None:
    assert call_1s("python", "while True:\n    pass") == "error: timed out after 1s"  # CPU
    sleeper = "import time\nprint('started', flush=True)\ntime.sleep(60)"  # wall clock, no CPU
    assert call_1s("python", sleeper) == "started\nerror: timed out after 1s"
    forks = "import os, time\nfor _ in range(4):\n    os.fork()\ntime.sleep(60)"  # 16 sleepers
    assert call_1s("python", forks) == "error: timed out after 1s"
    assert leftover_sandbox_processes() == []


def test_a_flood_of_output_is_truncated_and_reported(call, leftover_sandbox_processes) -> None:
    notice = f"[output truncated: over {OUTPUT_CHARS} chars]"
    # Endless output: the program is killed at the byte cap, long before the timeout would stop it.
    assert call("python", "while True:\n    print('x' * 1000)") == "x" * OUTPUT_CHARS + "\n" + notice
    assert call("python", "print('y' * 100)") == "y" * OUTPUT_CHARS + "\n" + notice
    assert call("python", "import sys\nsys.stderr.write('e' * 10**7)") == notice  # stderr counts too
    assert leftover_sandbox_processes() == []


def test_errors_come_back_as_short_text(call) -> None:
    assert call("python", "print('before')\n1 / 0") == "before\nerror: ZeroDivisionError: division by zero"
    assert call("python", "def (").startswith("error: SyntaxError: ")
    assert call("python", "import sys\nsys.exit(3)") == "error: exit status 3"
    assert call("shell", "ls") == "error: unknown tool 'shell' (tools: calculator, python)"
    assert call("calculator", "(8+3)%10") == "1"


NON_ROOT = """
import asyncio, json, os, sys
from areal_jobs.agent.tools import Toolbox
from areal_jobs.config import NetworkIsolation, RewardConfig
from areal_jobs.reward.service import RewardService

cfg = RewardConfig(num_workers=1, timeout_s=20.0, code_wall_timeout_s=3.0, code_cpu_s=2,
                   code_memory_mb=512, code_max_procs=16, network_isolation=NetworkIsolation.auto)
service = RewardService(cfg)
service.start()
try:
    box = Toolbox(service, 1.0, 64)
    programs = {"ok": "print(6 * 7)", "pid": "import os\\nos.getpid()", "hang": "while True:\\n    pass",
                "flood": "while True:\\n    print('x' * 1000)"}
    loop = asyncio.new_event_loop()
    out = {name: loop.run_until_complete(box.call("python", p)) for name, p in programs.items()}
    loop.close()
    out["uid"], out["mode"] = os.getuid(), service.isolation.value
finally:
    service.close()
print(json.dumps(out))
"""


def test_the_python_tool_works_as_a_non_root_user() -> None:
    proc = run_unprivileged([sys.executable, "-c", NON_ROOT], uid=SANDBOX_TOOLS_UID)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    out = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert out["uid"] != 0 and out["mode"] == "userns", out
    assert (out["ok"], out["pid"], out["hang"]) == ("42", "2", "error: timed out after 1s"), out
    assert out["flood"] == "x" * 64 + "\n[output truncated: over 64 chars]", out
