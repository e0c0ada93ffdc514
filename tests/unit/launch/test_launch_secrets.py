"""The job token and the run directory's modes (issue 28): the environment wins over run.token,
which wins over a generated token, for launch.local and launch.submit alike; the token is never
written to config.yaml; a user-set token reaches the SLURM job through sbatch's environment; the
run directory and what the launcher writes are private unless run.share_with_group."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from areal_jobs.config import (
    ClusterConfig,
    ClusterKind,
    JobConfig,
    ModelConfig,
    RunConfig,
    load_job_config,
    resolve_job_token,
    save_job_config,
)
from launch.slurm import golden
from launch.slurm.submit import prepare, submit


class RecordingSlurm:
    """The `Slurm` seam, faked: remembers the environment each submission would give sbatch."""

    def __init__(self) -> None:
        self.envs: list[dict[str, str] | None] = []

    def submit(self, script: Path, env: dict[str, str] | None = None) -> str:
        self.envs.append(env)
        return "1001"


def local_slurm_job(root: Path) -> JobConfig:
    return JobConfig(
        run=RunConfig(name="tiny", root=str(root)),
        model=ModelConfig(path="/models/tiny"),  # an empty path would build the built-in model
        cluster=ClusterConfig(kind=ClusterKind.slurm, nodes=4, gpus_per_node=1, loopback=True),
    )


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_environment_wins_then_the_config_then_a_generated_token() -> None:
    assert resolve_job_token(RunConfig(token="cfg"), {"AREAL_JOB_TOKEN": "env"})[0] == "env"
    token, source = resolve_job_token(RunConfig(token="cfg"), {})
    assert token == "cfg" and source.startswith("run.token")
    assert resolve_job_token(RunConfig(), {})[0] == ""


def test_config_yaml_never_holds_the_token(tmp_path: Path) -> None:
    job = local_slurm_job(tmp_path)
    job.run.token = "s3cr3t-token"
    save_job_config(job, tmp_path / "config.yaml")
    assert "s3cr3t-token" not in (tmp_path / "config.yaml").read_text()
    assert load_job_config(tmp_path / "config.yaml").run.token == ""


@pytest.mark.parametrize(
    ("environ", "run_token", "sent"),
    [
        ({}, "from-config", "from-config"),  # run.token reaches the job in sbatch's environment
        ({"AREAL_JOB_TOKEN": "from-env"}, "from-config", "from-env"),  # the environment wins
        ({}, "", None),  # neither: the job generates one at each attempt
    ],
)
def test_submit_passes_the_token_to_sbatch_and_writes_it_nowhere(tmp_path, capsys, environ, run_token, sent):
    job = local_slurm_job(tmp_path)
    job.run.token = run_token
    slurm = RecordingSlurm()
    submit(prepare(job, cwd=str(tmp_path), python=sys.executable), slurm, dry_run=False, environ=environ)
    env = slurm.envs[0]
    assert (env or {}).get("AREAL_JOB_TOKEN") == sent
    run_dir = tmp_path / "tiny"
    for path in run_dir.rglob("*"):
        if path.is_file() and run_token:
            assert run_token not in path.read_text(), path
    assert "job token: " in capsys.readouterr().out


@pytest.mark.parametrize(("share", "dir_mode", "file_mode"), [(False, 0o700, 0o600), (True, 0o750, 0o640)])
def test_the_run_directory_is_private_unless_shared_with_the_group(tmp_path, share, dir_mode, file_mode):
    job = local_slurm_job(tmp_path)
    job.run.share_with_group = share
    (tmp_path / "tiny").mkdir(mode=0o755)  # left by an older version
    (tmp_path / "tiny").chmod(0o755)
    submit(
        prepare(job, cwd=str(tmp_path), python=sys.executable), RecordingSlurm(), dry_run=False, environ={}
    )
    run_dir = tmp_path / "tiny"
    assert mode(run_dir) == dir_mode and mode(run_dir / "logs") == dir_mode
    assert mode(run_dir / "config.yaml") == mode(run_dir / "jobs.txt") == file_mode
    assert mode(run_dir / "job.sbatch") == dir_mode  # executable by its owner
    script = (run_dir / "job.sbatch").read_text()
    assert f"umask {0o777 & ~dir_mode:03o}\n" in script and f'chmod {dir_mode:o} "$RUN_DIR"' in script


def token_block(script: str) -> str:
    start = script.index(
        "# ------------------------------------------------------------------ per-job API key"
    )
    return script[
        start : script.index("# ------------------------------------------------------------------ service")
    ]


@pytest.mark.parametrize("given", ["user-token", ""])
def test_the_script_keeps_a_given_token_and_generates_one_otherwise(tmp_path: Path, given: str) -> None:
    script = golden.render_reference("small_1x8")
    run = (
        f'log() {{ echo "$*"; }}\nRUN_DIR={tmp_path}\n{token_block(script)}\n'
        'printf "%s" "$AREAL_JOB_TOKEN" > "$RUN_DIR/seen"\n'
    )
    env = {"PATH": "/usr/bin:/bin", **({"AREAL_JOB_TOKEN": given} if given else {})}
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", run], env=env, capture_output=True, text=True, check=True
    )
    token = (tmp_path / "job_token").read_text()
    assert mode(tmp_path / "job_token") == 0o600 and (tmp_path / "seen").read_text() == token
    if given:
        assert token == given and "job token: given at submission" in proc.stdout
    else:
        assert len(token) == 64 and "job token: generated for this attempt" in proc.stdout
