"""The suite's xdist groups take effect: `make test` runs `pytest -n 2 --dist loadgroup`, and
tests/conftest.py gives every module (or shared resource) one xdist_group, so a module's tests run
on one worker and its module fixtures are built once. pytest-xdist applies a group by rewriting the
item's node id, which pytest 9 no longer reads: every test silently became its own group (the
contract module's fixture was built on both workers). This runs a small grouped session and
checks where each module's tests ran."""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODULES = ["tests/unit/data/test_data_chat.py", "tests/unit/trainer/test_trainer_packing.py",
           "tests/unit/test_staleness.py", "tests/unit/data/test_data_prompts.py"]  # fmt: skip


def test_each_module_runs_on_one_worker():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider", *MODULES],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    workers = collections.defaultdict(set)
    for gw, nodeid in re.findall(r"\[(gw\d+)\] \[\s*\d+%\] PASSED (\S+)", proc.stdout):
        assert nodeid.endswith("@" + nodeid.split("::")[0]), nodeid  # the group xdist schedules by
        workers[nodeid.split("::")[0]].add(gw)
    assert set(workers) == set(MODULES), proc.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
