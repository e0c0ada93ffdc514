"""The one seam that talks to SLURM: sbatch, squeue, scontrol, scancel.

Everything else in launch/ is pure and calls a `Slurm` object; tests pass a fake. Also a small
CLI behind `make status JOB=<id>` and `make cancel JOB=<id>`:

    python -m launch.slurm status <job id>
    python -m launch.slurm cancel <job id>
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol


class SlurmError(RuntimeError):
    """A SLURM command failed; the message carries its stderr."""


class Slurm(Protocol):
    def submit(self, script: Path, env: Mapping[str, str] | None = None) -> str:
        """Submit a batch script (sbatch passes `env`, default ours, on to the job); return the job id."""
        ...

    def status(self, job_id: str) -> str:
        """Human-readable state of every component of the job."""
        ...

    def cancel(self, job_id: str) -> None: ...


def run_command(args: list[str], env: Mapping[str, str] | None = None) -> str:
    """Run one SLURM client command; its stdout, or SlurmError naming the command and its stderr."""
    if shutil.which(args[0]) is None:
        raise SlurmError(
            f"{args[0]} not found on PATH: run this on a SLURM login node, or render only with launch.dry_run=true"
        )
    proc = subprocess.run(args, check=False, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SlurmError(
            f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc.stdout


def parse_job_id(sbatch_parsable: str) -> str:
    """`sbatch --parsable` prints `<id>` or `<id>;<cluster>`."""
    job_id = sbatch_parsable.strip().split(";", 1)[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch --parsable printed {sbatch_parsable!r}, not a job id")
    return job_id


class SlurmCli:
    """The real thing: shells out to the SLURM client commands on PATH."""

    def submit(self, script: Path, env: Mapping[str, str] | None = None) -> str:
        return parse_job_id(run_command(["sbatch", "--parsable", str(script)], env=env))

    def status(self, job_id: str) -> str:
        queued = run_command(["squeue", "-h", "-j", job_id, "-o", "%i %j %T %M/%l %D %R"]).strip()
        if queued:
            return "JOBID NAME STATE TIME/LIMIT NODES REASON|NODELIST\n" + queued
        # finished jobs stay in the controller's memory for MinJobAge seconds
        shown = run_command(["scontrol", "-o", "show", "job", job_id])
        rows = []
        for line in shown.splitlines():
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            rows.append(f"{fields.get('JobId')} {fields.get('JobState')} exit={fields.get('ExitCode')}")
        return "\n".join(rows)

    def cancel(self, job_id: str) -> None:
        run_command(["scancel", job_id])


def signal_batch_script(job_id: str, signal: str = "TERM") -> bool:
    """Send `signal` to the job's batch script only (`scancel --batch`), so the script can end
    its own steps in order; False where scancel refused (the job is already gone)."""
    try:
        run_command(["scancel", "--batch", f"--signal={signal}", job_id])
    except SlurmError:
        return False
    return True


def cancel_quietly(job_id: str) -> bool:
    """`scancel <job>`, for a job that may already have ended; False where scancel refused."""
    try:
        run_command(["scancel", job_id])
    except SlurmError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launch.slurm", description="Watch or cancel a submitted job."
    )
    parser.add_argument("action", choices=["status", "cancel"])
    parser.add_argument("job_id", help="the id printed by `make submit` (the het job's leader id)")
    args = parser.parse_args(argv)
    if not args.job_id.isdigit():
        parser.error(f"job id must be a number, got {args.job_id!r} (e.g. make status JOB=1234)")
    slurm = SlurmCli()
    try:
        if args.action == "status":
            print(slurm.status(args.job_id))
        else:
            slurm.cancel(args.job_id)
            print(f"cancelled job {args.job_id}")
    except SlurmError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
