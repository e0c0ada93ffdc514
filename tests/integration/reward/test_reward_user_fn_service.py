"""A user's reward function through the real RewardService worker processes (reward.function):
a function that raises, hangs past reward.timeout_s, returns NaN or a string, or kills its worker
is a failed reward of its own kind, counted, its first traceback logged once, the service still
scoring; and reward.function_isolation=sandbox runs the file in the real code sandbox (as root
here, and as a non-root user through userns)."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from unprivileged import run_unprivileged

from areal_jobs.api import RewardRequest, RewardStatus
from areal_jobs.config import FunctionIsolation, NetworkIsolation, RewardConfig

BEHAVIOURS = """
import math, os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    kind = extra_info.get("kind", "ok")
    if kind == "raise":
        raise ValueError("cannot parse " + solution_str)
    if kind == "hang":
        time.sleep(60)
    if kind == "nan":
        return math.nan
    if kind == "string":
        return "1.0"
    if kind == "exit":
        os._exit(3)
    return {"score": float(solution_str == ground_truth), "length": len(solution_str),
            "host_etc_visible": float(os.path.exists("/etc/passwd")), "pid": os.getpid()}
"""

KINDS = ["ok", "raise", "nan", "string", "hang"]  # the hang last: the others finish before it
EXPECTED = {
    "ok": (1.0, RewardStatus.ok),
    "raise": (0.0, RewardStatus.fn_error),
    "hang": (0.0, RewardStatus.fn_timeout),
    "nan": (0.0, RewardStatus.fn_invalid),
    "string": (0.0, RewardStatus.fn_invalid),
}


def request(spec: str, kind: str) -> RewardRequest:
    return RewardRequest(spec, "42", "42", data_source="gsm8k", extra_info=json.dumps({"kind": kind}))


def user_file(directory: Path, marker: Path | None = None) -> Path:
    path = directory / "my_rewards.py"
    # an import-time write to a host path: it fails quietly where the host is out of reach
    prefix = f"try:\n    open({str(marker)!r}, 'w').write('x')\nexcept OSError:\n    pass\n" if marker else ""
    path.write_text(prefix + textwrap.dedent(BEHAVIOURS))
    return path


def isolation() -> NetworkIsolation:
    """The strong sandbox where this machine has one (as the reward conftest's `namespaces`)."""
    from areal_jobs.reward.sandbox_mode import resolve_isolation

    try:
        resolve_isolation(NetworkIsolation.auto)
    except RuntimeError:
        return NetworkIsolation.none
    return NetworkIsolation.auto


def wait_for_replacements(service) -> None:  # noqa: ANN001
    """A replaced worker's start-up (imports, sandbox self-check) would count against the next
    call's reward.timeout_s, which is kept small here: wait for it, as start() does."""
    for worker in service._workers:
        assert not worker.wait_ready(120.0).error


def config(spec: str, function_isolation: FunctionIsolation, timeout_s: float) -> RewardConfig:
    # small: a hang costs timeout_s; the sandbox's wall limit must be below it
    return RewardConfig(
        num_workers=2, timeout_s=timeout_s, code_wall_timeout_s=1.5, code_cpu_s=2, code_memory_mb=512,
        network_isolation=isolation(), function=spec, function_isolation=function_isolation,
    )  # fmt: skip


def test_each_failure_in_the_worker_processes_is_counted_by_kind_and_logged_once(
    scorer_factory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = f"{user_file(tmp_path)}:compute_score"
    caplog.set_level(logging.ERROR, logger="areal_jobs.reward.service")
    with scorer_factory(config(spec, FunctionIsolation.process, 3.0)) as s:
        pids = set(s.service.worker_pids())
        (first,) = s.score([request(spec, "raise")])  # the first failure: logged with its traceback
        assert first.status is RewardStatus.fn_error
        results = s.score([request(spec, k) for k in KINDS])
        assert [(r.reward, r.status) for r in results] == [EXPECTED[k] for k in KINDS]
        by_kind = dict(zip(KINDS, results, strict=True))
        assert by_kind["raise"].detail == f"reward.function={spec} raised ValueError: cannot parse 42"
        assert by_kind["hang"].detail == f"reward.function={spec} ran past reward.timeout_s=3"
        assert by_kind["nan"].detail == "compute_score returned nan, not a finite number"
        assert by_kind["string"].detail == "compute_score returned str '1.0', not a number"
        assert dict(by_kind["ok"].metrics)["length"] == 2.0
        assert set(s.service.worker_pids()) != pids  # the hung worker was killed and replaced
        wait_for_replacements(s.service)
        # a second raise and a dying worker: counted, not logged again; the service goes on
        again, died = s.score([request(spec, "raise"), request(spec, "exit")])
        assert again.status is RewardStatus.fn_error
        assert died.status is RewardStatus.fn_error and "its worker died (exit code 3)" in died.detail
        wait_for_replacements(s.service)
        (ok,) = s.score([request(spec, "ok")])
        assert ok.reward == 1.0
        metrics = s.service.metrics()
        assert metrics["reward/fn/length"] == 2.0  # the mean since the last report, of two ok calls
        assert "reward/fn/length" not in s.service.metrics()  # nothing new since
    counted = (metrics["reward/fn_errors"], metrics["reward/fn_timeouts"], metrics["reward/fn_invalid"])
    assert counted == (4, 1, 2)
    assert metrics["reward/ok"] == 2
    logged = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(logged) == 1, logged  # the first failure only, with its traceback
    assert (
        "fn_error" in logged[0]
        and "Traceback" in logged[0]
        and 'raise ValueError("cannot parse "' in logged[0]
    )


def test_sandbox_isolation_runs_the_file_in_the_code_sandbox(
    scorer_factory, namespaces: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "imported_on_the_host"
    spec = f"{user_file(tmp_path, marker)}:compute_score"
    caplog.set_level(logging.ERROR, logger="areal_jobs.reward.service")
    with scorer_factory(config(spec, FunctionIsolation.sandbox, 8.0)) as s:
        (first,) = s.score([request(spec, "raise")])  # the first failure: logged with its traceback
        results = s.score([request(spec, k) for k in KINDS])
    assert first.status is RewardStatus.fn_error
    assert [(r.reward, r.status) for r in results] == [EXPECTED[k] for k in KINDS]
    by_kind = dict(zip(KINDS, results, strict=True))
    ok = dict(by_kind["ok"].metrics)
    assert ok["length"] == 2.0
    if namespaces:  # the strong modes: a private root (no host /etc), its own PID namespace
        assert ok["host_etc_visible"] == 0.0 and ok["pid"] == 2.0, ok
        assert not marker.exists()  # its import-time write never reached the host
    assert "raised ValueError: cannot parse 42" in by_kind["raise"].detail
    assert "reward.code_wall_timeout_s=1.5" in by_kind["hang"].detail  # the sandbox's own wall limit
    logged = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(logged) == 1 and "Traceback" in logged[0] and "ValueError: cannot parse 42" in logged[0]


DRIVER = """
import json, sys
from areal_jobs.config import NetworkIsolation
from areal_jobs.reward.sandbox import SandboxLimits
from areal_jobs.reward.user_fn_sandbox import score_in_worker
limits = SandboxLimits(isolation=NetworkIsolation(sys.argv[2]), wall_timeout_s=3.0, cpu_s=2, memory_mb=512)
out = {}
for kind in ("ok", "raise"):
    result, trace = score_in_worker(sys.argv[1], "42", "42", "gsm8k", json.dumps({"kind": kind}), limits)
    out[kind] = [result.status.value, result.reward, dict(result.metrics), "Traceback" in trace]
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="as root, this drops to a non-root user to test that path")
def test_sandbox_isolation_as_a_non_root_user() -> None:
    directory = Path(tempfile.mkdtemp(prefix="areal-userfn-", dir="/tmp"))
    try:
        directory.chmod(0o755)
        spec = f"{user_file(directory)}:compute_score"
        (directory / "my_rewards.py").chmod(0o644)
        proc = run_unprivileged([sys.executable, "-c", DRIVER, spec, "userns"], timeout_s=120)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
        out = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    finally:
        for f in directory.iterdir():
            f.unlink()
        directory.rmdir()
    status, reward, metrics, _ = out["ok"]
    assert (status, reward) == ("ok", 1.0) and metrics["pid"] == 2.0 and metrics["host_etc_visible"] == 0.0, (
        out
    )
    assert out["raise"][0] == "fn_error" and out["raise"][3], out
