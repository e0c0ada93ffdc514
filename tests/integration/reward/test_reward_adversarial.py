"""Hostile programs, scored as one parallel group through the real service.

Each attack is written so that it earns reward 1 exactly when it succeeds (it prints the expected
output only if the attack worked, or fakes a HumanEval pass). Every one must get reward 0, and the
host must be unaffected: no sandboxed process survives, no file appears outside the sandbox, no
connection arrives, no secret leaks, and the workers (the sandbox's parents) stay alive.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from areal_jobs.api import RewardRequest, RewardResult, RewardStatus
from areal_jobs.config import RewardConfig

ANSWER_KEY = Path(__file__).resolve().parents[2] / "fixtures" / "humaneval" / "humaneval_head20.jsonl"
ADD_PROBLEM = json.dumps(
    {
        "prompt": 'def add(a, b):\n    """Return a + b."""\n',
        "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert abs(candidate(0.5, 0.25) - 0.75) < 1e-9\n",
        "entry_point": "add",
    }
)


def stdio(expected: str) -> str:
    return json.dumps({"tests": [{"input": "", "output": expected}]})


@dataclass
class Outcome:
    results: dict[str, RewardResult]
    workers_before: list[int]
    workers_after: list[int]
    leftovers: list[int]
    planted: dict[str, Path]
    connections: int
    benign_after: RewardResult


def attacks(
    port: int, planted: dict[str, Path], worker_pids: list[int], secret: str
) -> dict[str, RewardRequest]:
    """name -> request. Programs print the expected output only if the attack worked."""
    write_targets = [str(p) for p in planted.values()]
    return {
        "infinite loop": RewardRequest("code_stdio", "while True:\n    pass\nprint('done')", stdio("done")),
        "fork bomb": RewardRequest(
            "code_stdio",
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
            stdio("done"),
        ),
        "memory bomb": RewardRequest(
            "code_stdio", "hog = []\nwhile True:\n    hog.append(bytearray(64 << 20))\n", stdio("done")
        ),
        "gigabytes to stdout": RewardRequest(
            "code_stdio",
            "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(4096):\n    sys.stdout.write(chunk)\nprint('done')",
            stdio("done"),
        ),
        "network connection": RewardRequest(
            "code_stdio",
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
            stdio("connected"),
        ),
        # Success is judged on the host (test_nothing_was_written_outside_the_sandbox): in namespace
        # mode "/tmp" is the sandbox's own tmpfs, so a write there may succeed and stay inside. The
        # test-dir path cannot exist in any sandbox, so writing it means an escape.
        "write outside the sandbox": RewardRequest(
            "code_stdio",
            f"import os\nfor path in {write_targets!r}:\n"
            "    try:\n        open(path, 'w').write('pwned')\n    except OSError:\n        pass\n"
            f"print('written' if os.path.exists({write_targets[0]!r}) else 'refused')",
            stdio("written"),
        ),
        "read the parent's environment": RewardRequest(
            "code_stdio",
            "import os, re\nfound = [v for v in os.environ.values() if v.startswith('areal-secret-')]\n"
            "for pid in ['self', str(os.getppid())] + os.listdir('/proc'):\n"
            "    try:\n        data = open(f'/proc/{pid}/environ', 'rb').read().decode(errors='replace')\n"
            "    except OSError:\n        continue\n"
            "    found += re.findall(r'areal-secret-[0-9a-f]{32}', data)\n"
            "print(found[0] if found else 'nothing')",
            stdio(secret),
        ),
        "kill the parent": RewardRequest(
            "code_stdio",
            f"import os, signal\nkilled = 0\nfor pid in {worker_pids!r} + [os.getppid()] + "
            "[int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
            "    if pid in (0, os.getpid()):\n        continue\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n        killed += 1\n    except OSError:\n        pass\n"
            "print('killed' if killed else 'refused')",
            stdio("killed"),
        ),
        "read the answer key on the host": RewardRequest(
            "code_stdio",
            f"import json\nprint(json.loads(open({str(ANSWER_KEY)!r}).readline())['task_id'])",
            stdio("HumanEval/0"),
        ),
        "sleep past the timeout": RewardRequest(
            "code_stdio", "import time\ntime.sleep(3600)\nprint('done')", stdio("done")
        ),
        "os._exit(0) before the tests": RewardRequest(
            "humaneval", "import os\ndef add(a, b):\n    return 0\nos._exit(0)\n", ADD_PROBLEM
        ),
        "sys.exit(0) before the tests": RewardRequest(
            "humaneval", "import sys\ndef add(a, b):\n    return 0\nsys.exit(0)\n", ADD_PROBLEM
        ),
        "exit 0 from an atexit hook": RewardRequest(
            "humaneval",
            "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return 0\n",
            ADD_PROBLEM,
        ),
        "override check": RewardRequest(
            "humaneval", "def add(a, b):\n    return 0\n\ndef check(candidate):\n    pass\n", ADD_PROBLEM
        ),
        "override assert (AssertionError)": RewardRequest(
            "humaneval",
            "import builtins\nbuiltins.AssertionError = type('Ignored', (Exception,), {})\n"
            "def add(a, b):\n    return 0\n",
            ADD_PROBLEM,
        ),
        "override assert (re-exec with -O)": RewardRequest(
            "humaneval",
            "import os, sys\nif not sys.flags.optimize:\n    os.execv(sys.executable, [sys.executable, '-O', *sys.argv])\n"
            "def add(a, b):\n    return 0\n",
            ADD_PROBLEM,
        ),
        "always-equal return value": RewardRequest(
            "humaneval",
            "class Anything(int):\n    def __eq__(self, other):\n        return True\n"
            "    def __sub__(self, other):\n        return 0\n    __hash__ = int.__hash__\n"
            "def add(a, b):\n    return Anything()\n",
            ADD_PROBLEM,
        ),
        "patch a builtin the test uses": RewardRequest(
            "humaneval",
            "import builtins\ndef add(a, b):\n    builtins.abs = lambda x: 0\n    return 5\n",
            ADD_PROBLEM,
        ),
    }


@pytest.fixture(scope="module")
def outcome(tmp_path_factory, scorer_factory, small_limits, leftover_sandbox_processes) -> Iterator[Outcome]:
    """Run every attack once, as one group, and record what the host saw."""
    secret = f"areal-secret-{secrets.token_hex(16)}"
    old_secret = os.environ.get("AREAL_PLANTED_SECRET")
    # Planted before the workers start, so they (the sandboxes' parents) inherit it.
    os.environ["AREAL_PLANTED_SECRET"] = secret
    planted = {
        "test dir": tmp_path_factory.mktemp("planted") / "pwned.txt",
        "world-writable /tmp": Path(tempfile.gettempdir(), f"areal-attack-{secrets.token_hex(8)}.txt"),
    }
    cfg = RewardConfig(num_workers=2, timeout_s=20.0, **small_limits)
    try:
        with socket.create_server(("127.0.0.1", 0)) as listener, scorer_factory(cfg) as scorer:
            listener.settimeout(0.5)
            workers_before = scorer.service.worker_pids()
            requests = attacks(listener.getsockname()[1], planted, workers_before, secret)
            results = dict(zip(requests, scorer.score(list(requests.values())), strict=True))
            connections = 0
            try:
                listener.accept()[0].close()
                connections += 1
            except TimeoutError:
                pass
            leftovers = leftover_sandbox_processes()
            echo = json.dumps({"tests": [{"input": "hi\n", "output": "hi\n"}]})
            [benign] = scorer.score([RewardRequest("code_stdio", "print(input())", echo)])
            workers_after = scorer.service.worker_pids()
            yield Outcome(results, workers_before, workers_after, leftovers, planted, connections, benign)
    finally:
        for path in planted.values():
            path.unlink(missing_ok=True)
        if old_secret is None:
            os.environ.pop("AREAL_PLANTED_SECRET", None)
        else:
            os.environ["AREAL_PLANTED_SECRET"] = old_secret


ATTACK_NAMES = list(
    attacks(0, {"x": Path("/nonexistent")}, [], "")
)  # names only; the fixture builds the real ones
TIMEOUT_ATTACKS = {"infinite loop", "fork bomb", "sleep past the timeout"}
# What only the namespace mode stops (the fallback runs when we are not root or lack CAP_SYS_ADMIN).
NEEDS_NAMESPACES = {
    "network connection": "no network namespace, so programs keep network access",
    "kill the parent": "no PID namespace, so sandboxes sharing the sandbox uid can signal each other",
    "read the answer key on the host": "no chroot, so world-readable host files are readable",
}
# What only the uid drop stops (the worker must run as root to drop to the sandbox uid).
NEEDS_ROOT = {
    "kill the parent": "the program runs as the worker's own uid and may signal it",
    "read the parent's environment": "the program runs as the worker's own uid and may read /proc/<ppid>/environ",
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ATTACK_NAMES)
def test_attack_gets_zero_reward(outcome: Outcome, name: str, namespaces: bool) -> None:
    if name in NEEDS_NAMESPACES and not namespaces:
        pytest.skip(f"documented fallback limit: {NEEDS_NAMESPACES[name]}")
    if name in NEEDS_ROOT and os.geteuid() != 0:
        pytest.skip(f"documented limit without root: {NEEDS_ROOT[name]}")
    result = outcome.results[name]
    assert result.reward == 0.0, result
    if name in TIMEOUT_ATTACKS:
        assert result.status is RewardStatus.timeout, result
    else:
        assert result.status is RewardStatus.ok, result  # the program failed; the sandbox did not


def test_suite_covers_the_required_attacks() -> None:
    assert len(ATTACK_NAMES) >= 11


def test_no_sandboxed_process_survives(outcome: Outcome) -> None:
    assert outcome.leftovers == []


@pytest.mark.skipif(os.geteuid() != 0, reason="without root, programs run as the workers' uid (documented)")
def test_workers_survive_and_keep_working(outcome: Outcome) -> None:
    assert outcome.workers_after == outcome.workers_before
    for pid in outcome.workers_after:
        os.kill(pid, 0)  # raises if it is gone
    assert outcome.benign_after.reward == 1.0


def test_nothing_was_written_outside_the_sandbox(outcome: Outcome, namespaces: bool) -> None:
    assert not outcome.planted["test dir"].exists()
    if not namespaces:
        pytest.skip("without a mount namespace the sandbox uid may write to world-writable /tmp (documented)")
    assert not outcome.planted["world-writable /tmp"].exists()


def test_no_connection_reached_the_host(outcome: Outcome, namespaces: bool) -> None:
    if not namespaces:
        pytest.skip("without a network namespace programs keep network access (documented fallback)")
    assert outcome.connections == 0
