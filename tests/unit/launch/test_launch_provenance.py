"""A rendered script says what produced it (issue 28): the command-line overrides and the commit,
dirty or not, beside the plan line; the committed reference renders carry a fixed source so the
golden test does not depend on the current commit."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from areal_jobs.config import ClusterConfig, ClusterKind, JobConfig
from launch.slurm import golden
from launch.slurm.render import Provenance
from launch.slurm.submit import git_source, prepare


def header(script: str) -> list[str]:
    return script.splitlines()[:12]


def test_the_script_records_overrides_and_source_beside_the_plan() -> None:
    provenance = Provenance(
        overrides=("cluster=local_slurm", "run.name=my run"), source="git abc (clean) in /r"
    )
    job = JobConfig(cluster=ClusterConfig(kind=ClusterKind.slurm, nodes=4, gpus_per_node=1))
    lines = header(prepare(job, cwd="/w", python="/w/py", provenance=provenance).script)
    plan = next(i for i, line in enumerate(lines) if line.startswith("# Plan: "))
    assert lines[plan + 1] == "# Command: python -m launch.submit cluster=local_slurm 'run.name=my run'"
    assert lines[plan + 2] == "# Source: git abc (clean) in /r"


def test_a_token_on_the_command_line_is_not_written_into_the_script() -> None:
    provenance = Provenance(overrides=("run.token=s3cr3t", "+run.token=s3cr3t", "run.name=x"))
    assert provenance.command_line() == (
        "python -m launch.submit run.token=REDACTED +run.token=REDACTED run.name=x"
    )


def test_golden_renders_do_not_depend_on_the_commit() -> None:
    for name, (experiment, _extra) in golden.REFERENCES.items():
        lines = header(golden.render_reference(name))
        command = " ".join(["python -m launch.submit", f"experiment={experiment}", *golden.COMMON_OVERRIDES])
        assert any(line.startswith(f"# Command: {command}") for line in lines), name
        assert f"# Source: {golden.GOLDEN_SOURCE}" in lines
        assert not any(re.search(r"[0-9a-f]{40}", line) for line in lines)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def test_git_source_says_commit_and_whether_the_tree_is_dirty(tmp_path: Path) -> None:
    assert "not a git checkout" in git_source(tmp_path)
    git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git(tmp_path, "add", "a.py")
    git(tmp_path, "commit", "-qm", "one")
    sha = git(tmp_path, "rev-parse", "HEAD")
    assert git_source(tmp_path) == f"git {sha} (clean) in {tmp_path}"
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "b.py").write_text("new\n")  # untracked code runs too
    assert git_source(tmp_path).startswith(f"git {sha} + uncommitted changes (2 paths")
