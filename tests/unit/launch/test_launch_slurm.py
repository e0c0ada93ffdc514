"""The SLURM seam (launch/slurm/cli.py) against stand-in client commands on PATH."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.slurm import cli as slurm
from launch.slurm.cli import SlurmCli, SlurmError, parse_job_id


def put_on_path(monkeypatch, tmp_path: Path, **scripts: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\n{body}\n")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))  # only the stand-ins: a real SLURM must not answer


@pytest.mark.parametrize(("printed", "job_id"), [("1234\n", "1234"), ("77;cluster-a\n", "77")])
def test_parse_job_id(printed: str, job_id: str) -> None:
    assert parse_job_id(printed) == job_id


def test_parse_job_id_rejects_noise() -> None:
    with pytest.raises(SlurmError, match="not a job id"):
        parse_job_id("Submitted batch job 12")


def test_submit_passes_parsable_and_returns_the_id(monkeypatch, tmp_path: Path) -> None:
    put_on_path(monkeypatch, tmp_path, sbatch=f'echo "$@" > {tmp_path}/args; echo "981;c1"')
    assert SlurmCli().submit(tmp_path / "job.sbatch") == "981"
    assert (tmp_path / "args").read_text() == f"--parsable {tmp_path}/job.sbatch\n"


def test_sbatch_failure_carries_its_message(monkeypatch, tmp_path: Path) -> None:
    put_on_path(monkeypatch, tmp_path, sbatch="echo 'sbatch: error: invalid account' >&2; exit 1")
    with pytest.raises(SlurmError, match="invalid account"):
        SlurmCli().submit(tmp_path / "job.sbatch")


def test_missing_client_suggests_dry_run(monkeypatch, tmp_path: Path) -> None:
    put_on_path(monkeypatch, tmp_path)
    with pytest.raises(SlurmError, match="launch.dry_run=true"):
        SlurmCli().submit(tmp_path / "job.sbatch")


def test_status_lists_queued_components_then_falls_back_to_scontrol(monkeypatch, tmp_path: Path) -> None:
    put_on_path(monkeypatch, tmp_path, squeue="echo '5+0 exp RUNNING 1:00/10:00 3 n[1-3]'")
    assert "5+0 exp RUNNING" in SlurmCli().status("5")
    put_on_path(
        monkeypatch,
        tmp_path,
        squeue="true",
        scontrol="echo 'JobId=5 HetJobId=5 JobState=COMPLETED ExitCode=0:0'; echo 'JobId=6 JobState=FAILED ExitCode=1:0'",
    )
    assert SlurmCli().status("5") == "5 COMPLETED exit=0:0\n6 FAILED exit=1:0"


def test_cli_cancel_and_bad_job_id(monkeypatch, tmp_path: Path, capsys) -> None:
    put_on_path(monkeypatch, tmp_path, scancel=f'echo "$@" > {tmp_path}/cancelled')
    assert slurm.main(["cancel", "42"]) == 0
    assert (tmp_path / "cancelled").read_text() == "42\n"
    with pytest.raises(SystemExit):
        slurm.main(["status", "JOB"])
    assert "make status JOB=1234" in capsys.readouterr().err


REPO = Path(__file__).resolve().parents[3]


def test_status_and_cancel_need_no_venv() -> None:
    """`make status` / `make cancel` run launch/slurm/cli.py with the system python and install nothing:
    it imports the standard library only, and the make targets do not depend on `install`."""
    import subprocess
    import sys

    code = (
        "import sys\nimport launch.slurm.cli\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names) - {'launch', '__main__'}))"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    usage = subprocess.run(
        [sys.executable, "-S", "-m", "launch.slurm", "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )  # the command the make targets run, through launch/slurm/__main__.py
    assert usage.returncode == 0 and "status" in usage.stdout, usage.stdout + usage.stderr
    for action in ("status", "cancel"):
        dry = subprocess.run(
            ["make", "-n", "--no-print-directory", action, "JOB=1", "VENV=/nonexistent"],
            cwd=REPO, capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert "pip_install" not in dry.stdout, dry.stdout
        assert dry.stdout.splitlines()[-1].split() == ["python3", "-m", "launch.slurm", action, "1"], (
            dry.stdout
        )
