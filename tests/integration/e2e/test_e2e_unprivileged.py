"""`python -m launch.local` (what `make run` runs) as a non-root user, as a cluster user runs it:
real SGLang server, controller, reward workers (sandboxed through a user namespace: `auto` picks
it without root) and trainer, all as that user, for a few steps. Everything the run writes belongs
to the user; nothing needs root. (As root, the run is dropped to nobody: reward/unprivileged.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.integration.reward.unprivileged import NOBODY, run_unprivileged

from .test_e2e_local import local_cmd

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

STEPS = 3


def test_make_run_works_without_root(tiny_model_dir):
    # pytest's own temp dirs are private to root (0700): the user gets a world-traversable one
    shared = Path(tempfile.mkdtemp(prefix="areal-unprivileged-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        model = shared / "model"
        shutil.copytree(tiny_model_dir, model)
        for path in (model, *model.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
        runs = shared / "runs"
        runs.mkdir(mode=0o777)
        runs.chmod(0o777)  # mkdir's mode is cut by the umask
        argv = local_cmd(runs, model, "as-user", f"trainer.total_steps={STEPS}")
        result = run_unprivileged(argv, env={"TMPDIR": "/tmp"}, timeout_s=900)
        out = result.stdout.decode(errors="replace")[-3000:] + result.stderr.decode(errors="replace")[-3000:]
        assert result.returncode == 0, out
        run_dir = runs / "as-user"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == STEPS, out
        rows = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        if os.geteuid() == 0:  # it really ran as the user: every file it wrote is the user's
            owners = {p.stat().st_uid for p in run_dir.rglob("*")}
            assert owners == {NOBODY}, owners
    finally:
        shutil.rmtree(shared, ignore_errors=True)
