"""Sandbox uid claims: exclusive per live process, released when the holder dies."""

from __future__ import annotations

import os
import subprocess
import sys

from areal_jobs.reward.sandbox_uids import claim_sandbox_uid

FIRST = 1_950_000_000  # a range no process here runs as


def test_claims_are_exclusive_and_die_with_their_holder(tmp_path) -> None:
    lock_dir = str(tmp_path / "locks")
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from areal_jobs.reward.sandbox_uids import claim_sandbox_uid as c\n"
         f"print(c({FIRST}, 4, {lock_dir!r}), flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdin is not None
    assert int(holder.stdout.readline()) == FIRST
    # Another service (here: this process) gets the next uids, never the held one.
    assert claim_sandbox_uid(FIRST, 4, lock_dir) == FIRST + 1
    assert claim_sandbox_uid(FIRST, 4, lock_dir) == FIRST + 2
    holder.stdin.close()
    holder.wait(timeout=30)
    # The holder is gone, and so is its lock: its uid is free again.
    assert claim_sandbox_uid(FIRST, 4, lock_dir) == FIRST


def test_all_taken_is_an_error_naming_the_override(tmp_path) -> None:
    lock_dir = str(tmp_path / "locks")
    claim_sandbox_uid(FIRST + 10, 1, lock_dir)
    try:
        claim_sandbox_uid(FIRST + 10, 1, lock_dir)
    except RuntimeError as e:
        assert "reward.code_sandbox_uid_count" in str(e)
    else:
        raise AssertionError("a second claim of a one-uid range succeeded")


def test_a_uid_with_live_processes_is_skipped(tmp_path) -> None:
    mine = os.getuid()  # this process runs as it
    assert claim_sandbox_uid(mine, 2, str(tmp_path / "locks")) == mine + 1
