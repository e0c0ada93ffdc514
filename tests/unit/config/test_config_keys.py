"""An unknown key fails whichever way it is written (issue 28), naming the closest real key: Hydra
refuses `cluster.nodse=64` but suggests `+cluster.nodse=64`, which it lets into the structured
config; building the dataclasses then dropped it and the job ran with the default."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from areal_jobs.config import (
    JobConfig,
    check_override_keys,
    closest_key,
    load_job_config,
    register_configs,
    save_job_config,
    schema_keys,
    to_job_config,
)

REPO = Path(__file__).resolve().parents[3]
CONF = REPO / "conf"


def compose_job(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return to_job_config(compose("submit", overrides=list(overrides)))


@pytest.mark.parametrize("override", ["+cluster.nodse=64", "++cluster.nodse=64"])
def test_a_plus_key_hydra_lets_in_is_refused_with_the_closest_key(override: str) -> None:
    with pytest.raises(ValueError, match=r"cluster\.nodse \(did you mean cluster\.nodes\?\)"):
        compose_job("experiment=math_qwen2_1p5b", override)


def test_keys_under_a_dict_field_are_the_users_own() -> None:
    job = compose_job("experiment=math_qwen2_1p5b", "+cluster.nccl_env.NCCL_DEBUG=INFO")
    assert job.cluster.nccl_env["NCCL_DEBUG"] == "INFO"


def test_a_saved_config_with_an_unknown_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    save_job_config(compose_job(), path)
    cfg = OmegaConf.load(path)
    cfg.trainer.lrr = 0.1
    OmegaConf.save(cfg, path)
    with pytest.raises(ValueError, match=r"trainer\.lrr \(did you mean trainer\.lr\?\)"):
        load_job_config(path)


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("cluster.nodse", "cluster.nodes"),
        ("algo.max_stalenes", "algo.max_staleness"),
        ("rollout.workflow.max_turn", "rollout.workflow.max_turns"),
        ("nodes", "cluster.nodes"),  # the section left out
        ("cluster.zzzzzz", None),
    ],
)
def test_closest_key(key: str, meant: str | None) -> None:
    assert closest_key(key, schema_keys(JobConfig)) == meant


def test_command_line_keys_are_checked_in_every_spelling() -> None:
    for spelling in ("cluster.nodse=64", "+cluster.nodse=64", "++cluster.nodse=64", "~cluster.nodse"):
        with pytest.raises(ValueError, match="did you mean cluster.nodes"):
            check_override_keys([spelling], CONF, JobConfig)
    # groups, Hydra's own options, flags and user keys of dict fields pass
    check_override_keys(
        [
            "-m",
            "--cfg",
            "job",
            "experiment=math_qwen2_7b",
            "cluster=h800",
            "rollout/engine=vllm",
            "+experiment=code_qwen2_14b",
            "hydra.sweep.dir=/tmp/x",
            "cluster.nodes=4",
            "+cluster.nccl_env.NCCL_DEBUG=INFO",
            "cluster.sbatch_args=[--constraint=h800]",
            "algo.max_staleness=0,4,8",
        ],
        CONF,
        JobConfig,
    )


@pytest.mark.parametrize("module", ["launch.local", "launch.submit"])
@pytest.mark.parametrize("spelling", ["cluster.nodse=64", "+cluster.nodse=64"])
def test_both_commands_refuse_both_spellings(module: str, spelling: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", module, f"run.root={tmp_path}/runs", "launch.dry_run=true", spelling]
        + (["experiment=math_qwen2_1p5b"] if module == "launch.submit" else []),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert "cluster.nodse (did you mean cluster.nodes?)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()
