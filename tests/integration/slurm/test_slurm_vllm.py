"""`rollout/engine=vllm` as one heterogeneous SLURM job: `make submit` with cluster=local_slurm.

The rendered script exports the vLLM venv's interpreter; the rollout node runs one CPU vLLM server
from it (worker extension and API-key middleware loaded from the checkout), the trainer node the
torch trainer and the controller; weights reach the server by broadcast. Two fake nodes (one
rollout, one trainer) keep it to one vLLM server on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from local_slurm import LocalSlurm
from test_slurm_pipeline import dump_logs, lean_overrides, make_submit

from areal_jobs.metrics import read_jsonl
from areal_jobs.rollout.vllm_server import VENV_PYTHON

pytestmark = [pytest.mark.slurm, pytest.mark.vllm, pytest.mark.slow]

JOB_TIMEOUT_S = 1200


def test_vllm_experiment_completes_as_a_het_job(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    if not VENV_PYTHON.exists():
        pytest.fail(f"{VENV_PYTHON} is missing: run `make vllm-venv` (make test does)")
    total_steps = 3
    overrides = lean_overrides(tmp_path, "tiny-slurm-vllm", total_steps)
    overrides += [
        "rollout/engine=vllm",
        "rollout.kv_cache_gib=0.25",
        "cluster.nodes=2",
        "cluster.rollout_fraction=0.5",
    ]
    job_id = make_submit(slurm_cluster, overrides)
    run_dir = tmp_path / "runs" / "tiny-slurm-vllm"
    states = slurm_cluster.wait_until_done(job_id, timeout_s=JOB_TIMEOUT_S)
    assert states == ["COMPLETED", "COMPLETED"], dump_logs(run_dir)

    script = (run_dir / "job.sbatch").read_text()
    assert "export ROLLOUT_ENGINE=vllm" in script and f"AREAL_ENGINE_PYTHON={VENV_PYTHON}" in script
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == total_steps and summary["max_staleness_seen"] <= 1
    assert sum("train/version" in row for row in read_jsonl(run_dir / "metrics.jsonl")) == total_steps
    logs = run_dir / "logs"
    assert "vllm server starting" in (logs / "rollout-server-0.log").read_text()
    assert (logs / "vllm-0.log").exists()
    controller = (logs / "controller.log").read_text()
    assert f"version {total_steps} on the servers" in controller and "eval final" in controller
    assert "trainer exited with 0" in (logs / f"sbatch-{job_id}.out").read_text()
    assert slurm_cluster.leftover_job_processes() == []
