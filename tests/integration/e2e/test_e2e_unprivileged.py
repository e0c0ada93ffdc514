"""The launchers as a non-root user, as a cluster user runs them (as root, the commands are
dropped to nobody: tests/integration/reward/unprivileged.py):
- `python -m launch.local` (what `make run` runs): real SGLang server, controller, reward workers
  (sandboxed through a user namespace: `auto` picks it without root) and trainer, all as that
  user, asynchronously (eta = 4): the run is also test_e2e_local's check of the staleness bound
  and of interrupted generations (`check_async_run`). Everything the run writes belongs to the user.
- `python -m launch.submit` (what `make submit` runs) renders the run directory and calls sbatch
  as that user (a recording sbatch: the SLURM tests in tests/integration/slurm run the real one).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.integration.reward.unprivileged import NOBODY, run_unprivileged

from .test_e2e_local import ASYNC_STEPS, check_async_run, local_cmd

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def user_dir() -> Path:
    """pytest's own temp dirs are private to root (0700): the user gets a world-traversable one."""
    shared = Path(tempfile.mkdtemp(prefix="areal-unprivileged-", dir="/tmp"))
    shared.chmod(0o755)
    return shared


def test_make_run_works_without_root_and_keeps_the_staleness_bound(tiny_model_dir):
    shared = user_dir()
    try:
        model = shared / "model"
        shutil.copytree(tiny_model_dir, model)
        for path in (model, *model.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
        runs = shared / "runs"
        runs.mkdir(mode=0o777)
        runs.chmod(0o777)  # mkdir's mode is cut by the umask
        argv = local_cmd(runs, model, "as-user", "algo.max_staleness=4", f"trainer.total_steps={ASYNC_STEPS}")
        result = run_unprivileged(argv, env={"TMPDIR": "/tmp"}, timeout_s=900)
        out = result.stdout.decode(errors="replace")[-3000:] + result.stderr.decode(errors="replace")[-3000:]
        assert result.returncode == 0, out
        run_dir = runs / "as-user"
        assert "final: accuracy_start=" in result.stdout.decode(errors="replace"), out
        check_async_run(run_dir)
        if os.geteuid() == 0:  # it really ran as the user: every file it wrote is the user's
            owners = {p.stat().st_uid for p in run_dir.rglob("*")}
            assert owners == {NOBODY}, owners
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_make_submit_works_without_root():
    shared = user_dir()
    try:
        bin_dir, runs = shared / "bin", shared / "runs"
        bin_dir.mkdir()
        runs.mkdir()
        runs.chmod(0o777)
        record = runs / "sbatch-calls"
        sbatch = bin_dir / "sbatch"
        sbatch.write_text(f'#!/bin/sh\nid -u >> {record}\necho "$@" >> {record}\necho 4242\n')
        sbatch.chmod(0o755)
        argv = [sys.executable, "-m", "launch.submit", "experiment=math_qwen2_7b", f"run.root={runs}"]
        result = run_unprivileged(
            argv, env={"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin"}, timeout_s=300
        )
        out = result.stdout.decode(errors="replace")[-3000:] + result.stderr.decode(errors="replace")[-3000:]
        assert result.returncode == 0, out
        assert "submitted job 4242" in out
        script = runs / "math_qwen2_7b" / "job.sbatch"
        uid, args = record.read_text().splitlines()
        assert args == f"--parsable {script}"
        if os.geteuid() == 0:
            assert int(uid) == NOBODY and script.stat().st_uid == NOBODY
    finally:
        shutil.rmtree(shared, ignore_errors=True)
