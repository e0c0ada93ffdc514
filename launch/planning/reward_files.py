"""A user's reward functions at launch: checked before any server starts, copied into the run
directory with their sha256 (`make run` and `make submit` alike).

The functions are `reward.function` and, in a mixture, each `data.sources.<i>.reward` that is a
function spec rather than a built-in verifier name. Checking one (`check_functions`):
- reward.function_isolation=process: the file is imported here, the function looked up and its
  signature told (reward/user_fn.py), so a file that does not import, a missing function or a
  wrong signature is refused at once, naming the key, not by every reward of the run;
- =sandbox: the file is never run here (its code is not trusted); its syntax tree is read for the
  function and its signature (reward/user_fn_sandbox.py).
On SLURM a file not visible on the submitting machine is a warning (it may sit on a node-only
path); `make run` needs it here.

A file's copy (`record`) goes to RUN_DIR/reward_functions/<sha256[:12]>-<name>.py, listed with the
spec, the path the roles import and the full sha256 in RUN_DIR/reward_functions.json; the sbatch
script names the same in its header. The roles import the configured path, not the copy: the copy
and the hash say exactly which code a run used (a resumed run whose file changed gets a warning).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from pathlib import Path

from areal_jobs.config import FunctionIsolation, JobConfig
from areal_jobs.reward.user_fn import UserFunctionError, check, is_function_spec, parse_spec
from areal_jobs.reward.user_fn_sandbox import static_signature

logger = logging.getLogger(__name__)

RECORD = "reward_functions.json"
COPIES = "reward_functions"


def function_specs(job: JobConfig) -> list[tuple[str, str]]:
    """(config key, spec) of every user reward function the job names."""
    found = [("reward.function", job.reward.function)] if job.reward.function else []
    for i, source in enumerate(getattr(job.data, "sources", None) or ()):
        reward = getattr(source, "reward", "")
        if reward and is_function_spec(reward):
            found.append((f"data.sources.{i}.reward", reward))
    return found


def absolute_paths(job: JobConfig, base: Path) -> JobConfig:
    """The job with every function file given as an absolute path (relative ones under `base`):
    every role, on every node, imports the same file whatever its working directory."""

    def fix(spec: str) -> str:
        parsed = parse_spec(spec)
        if not parsed.is_file:
            return spec
        return f"{base / parsed.location}:{parsed.name}"  # an absolute location stays as it is

    if job.reward.function:
        job = dataclasses.replace(
            job, reward=dataclasses.replace(job.reward, function=fix(job.reward.function))
        )
    sources = getattr(job.data, "sources", None)
    if sources:
        fixed = [
            dataclasses.replace(s, reward=fix(s.reward)) if s.reward and is_function_spec(s.reward) else s
            for s in sources
        ]
        job = dataclasses.replace(job, data=dataclasses.replace(job.data, sources=type(sources)(fixed)))
    return job


def check_functions(job: JobConfig, *, missing_ok: bool = False) -> list[str]:
    """Raise ValueError naming the key and what is wrong for a function that cannot be used.
    `missing_ok` (SLURM): a file not visible here is returned as a warning instead."""
    warnings = []
    sandboxed = job.reward.function_isolation is FunctionIsolation.sandbox
    for key, spec in function_specs(job):
        parsed = parse_spec(spec, key)
        if parsed.is_file and not Path(parsed.location).is_file():
            if missing_ok:
                warnings.append(f"{key}={parsed.text}: no file {parsed.location} here")
                continue
            raise ValueError(f"{key}={parsed.text}: no file {parsed.location}")
        try:
            if sandboxed:
                static_signature.__wrapped__(spec, key)  # uncached: the file as it is now
            else:
                check(spec, key)
        except UserFunctionError as e:
            raise ValueError(str(e)) from None
    return warnings


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def describe(job: JobConfig) -> list[str]:
    """One line per function for the sbatch header: its spec and its file's sha256 here."""
    lines = []
    for key, spec in function_specs(job):
        parsed = parse_spec(spec, key)
        path = Path(parsed.location)
        if not parsed.is_file:
            lines.append(f"{key}={parsed.text} (an installed module)")
        elif path.is_file():
            lines.append(f"{key}={parsed.text} (sha256 {sha256_of(path)}, copied to $RUN_DIR/{COPIES}/)")
        else:
            lines.append(f"{key}={parsed.text} (not visible on the submitting machine)")
    return lines


def record(job: JobConfig, run_dir: Path) -> list[dict[str, str]]:
    """Copy each visible function file into the run directory and write RECORD; returns its rows."""
    rows = []
    for key, spec in function_specs(job):
        parsed = parse_spec(spec, key)
        path = Path(parsed.location)
        if not parsed.is_file or not path.is_file():
            rows.append({"key": key, "spec": spec, "path": parsed.location, "sha256": "", "copy": ""})
            continue
        digest = sha256_of(path)
        copy = run_dir / COPIES / f"{digest[:12]}-{path.name}"
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
        rows.append({"key": key, "spec": spec, "path": str(path), "sha256": digest, "copy": str(copy)})
    previous = _read(run_dir / RECORD)
    for row in rows:
        old = previous.get(row["key"])
        if old and old.get("sha256") and old["sha256"] != row["sha256"]:
            logger.warning(
                "%s=%s changed since this run last started (sha256 %s, now %s): the resumed run "
                "scores with the new code; the old one is kept as %s",
                row["key"], row["spec"], old["sha256"][:12], row["sha256"][:12], old.get("copy", "?"),
            )  # fmt: skip
        logger.info(
            "%s=%s: sha256 %s, copied to %s",
            row["key"],
            row["spec"],
            row["sha256"] or "-",
            row["copy"] or "-",
        )
    if rows:
        (run_dir / RECORD).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def _read(path: Path) -> dict[str, dict]:
    try:
        return {row["key"]: row for row in json.loads(path.read_text())}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
