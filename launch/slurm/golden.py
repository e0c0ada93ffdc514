"""Committed reference renders in sbatch/: `make golden` regenerates them, a test diffs them.

    python -m launch.slurm.golden            # rewrite sbatch/<reference>.sbatch
    python -m launch.slurm.golden --check    # exit 1 with a diff if any render is out of date

Each reference is a conf/experiment/*.yaml (plus overrides) composed exactly as `make submit` would,
with a fixed shared-filesystem layout (/shared/areal_jobs) instead of the caller's directory and
interpreter, so the files do not depend on who renders them.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from areal_jobs.config import register_configs, to_job_config
from launch.slurm.render import Provenance
from launch.slurm.submit import prepare

REPO = Path(__file__).resolve().parents[2]
CONF_DIR = REPO / "conf"
SBATCH_DIR = REPO / "sbatch"
WORKDIR = "/shared/areal_jobs"
PYTHON = "/shared/areal_jobs/.venv/bin/python"
# a submitted job records its commit; the references record this instead, so they do not change
# with every commit (their overrides are real: the command that gives the same script)
GOLDEN_SOURCE = "fixed for the committed reference renders (launch/slurm/golden.py); a submitted job records its git commit here"

# reference name -> experiment and extra overrides (sbatch/<name>.sbatch); the account/qos
# placeholders show ops where site values go
COMMON_OVERRIDES = ["cluster.account=rl-team", "cluster.qos=normal"]
REFERENCES: dict[str, tuple[str, list[str]]] = {
    "math_qwen2_1p5b": ("math_qwen2_1p5b", []),
    "math_qwen2_1p5b_vllm": ("math_qwen2_1p5b", ["rollout/engine=vllm"]),
    "math_qwen2_7b": ("math_qwen2_7b", []),
    # a mixture of experts (Qwen3-30B-A3B): Megatron's expert parallelism in the plan line
    "moe_qwen3_30b_a3b": ("moe_qwen3_30b_a3b", []),
    # small clusters (docs/small-clusters.md): GPU-level splits 6 + 2, 12 + 4 and 18 + 6
    "small_1x8": ("math_qwen2_1p5b", ["cluster.nodes=1"]),
    "small_2x8": ("math_qwen2_1p5b", ["cluster.nodes=2"]),
    "small_3x8": ("math_qwen2_1p5b", ["cluster.nodes=3"]),
    "code_qwen2_14b": (
        "code_qwen2_14b",
        [
            "cluster.container_image=/shared/images/areal_jobs.sqsh",
            "cluster.container_mounts=/shared:/shared",
        ],
    ),
}


def render_reference(name: str) -> str:
    """The script `make submit EXP=<experiment> OVERRIDES=...` would submit from /shared/areal_jobs."""
    register_configs()
    GlobalHydra.instance().clear()
    experiment, extra = REFERENCES[name]
    overrides = [f"experiment={experiment}", *COMMON_OVERRIDES, *extra]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="submit", overrides=overrides)
    provenance = Provenance(overrides=tuple(overrides), source=GOLDEN_SOURCE)
    return prepare(to_job_config(cfg), cwd=WORKDIR, python=PYTHON, provenance=provenance).script


def golden_path(name: str) -> Path:
    return SBATCH_DIR / f"{name}.sbatch"


def diff_against_golden(experiment: str) -> str:
    """Empty when the committed render matches; else a unified diff (committed -> rendered)."""
    path = golden_path(experiment)
    committed = path.read_text() if path.exists() else ""
    rendered = render_reference(experiment)
    return "".join(
        difflib.unified_diff(
            committed.splitlines(keepends=True),
            rendered.splitlines(keepends=True),
            fromfile=f"{path.relative_to(REPO)} (committed)",
            tofile=f"{path.relative_to(REPO)} (rendered now)",
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launch.slurm.golden", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    args = parser.parse_args(argv)
    stale = 0
    for experiment in REFERENCES:
        if args.check:
            diff = diff_against_golden(experiment)
            if diff:
                stale += 1
                sys.stdout.write(diff)
        else:
            golden_path(experiment).write_text(render_reference(experiment))
            print(f"wrote {golden_path(experiment).relative_to(REPO)}")
    if stale:
        print(f"{stale} render(s) out of date: run `make golden` and review the diff", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
