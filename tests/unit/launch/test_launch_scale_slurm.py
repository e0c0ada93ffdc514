"""launch.scale on a SLURM run: the satellite job's script, its server indices, the bookkeeping in
RUN_DIR/satellites.json and what `-N` refuses (tests/integration/slurm/test_slurm_scale.py runs it)."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest

from areal_jobs.config import (
    AlgoConfig,
    ClusterConfig,
    ClusterKind,
    JobConfig,
    RolloutConfig,
    RunConfig,
    TrainerBackend,
    TrainerConfig,
    save_job_config,
)
from areal_jobs.transport import discovery
from launch.planning.layout.plan import apply_plan, plan_job
from launch.run.scale import main
from launch.slurm import satellites as scale_slurm
from launch.slurm.satellites import Satellite, next_index, read_satellites, render_satellite, write_satellites


def planned_job(**cluster) -> JobConfig:
    """64 H800 nodes, TP-2 servers: 4 servers per rollout node."""
    fields = {"kind": ClusterKind.slurm, "nodes": 64, "workdir": "/shared/aj", "python": "python3", **cluster}
    job = JobConfig(
        run=RunConfig(name="exp", root="runs"),
        cluster=ClusterConfig(**fields),
        rollout=RolloutConfig(tp_size=2),
        trainer=TrainerConfig(backend=TrainerBackend.megatron),
        algo=AlgoConfig(batch_size=64, group_size=8),
    )
    return apply_plan(job, plan_job(job))


def test_satellite_script_is_one_node_of_the_runs_servers(tmp_path) -> None:
    job = planned_job(partition="h800", nccl_env={"NCCL_IB_HCA": "mlx5"})
    script, count = render_satellite(job, tmp_path, "4242", first_index=192)
    assert count == 4  # 8 GPUs / TP 2
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --no-requeue" in header and "#SBATCH --partition=h800" in header
    assert "#SBATCH --nodes=1 --ntasks-per-node=4 --cpus-per-task=8 --gres=gpu:8 --exclusive" in header
    assert "hetjob" not in script and "{{" not in script
    assert "export FIRST_INDEX=192\n" in script and "MAIN_JOB=4242\n" in script
    assert "servers 192..195" in script and "export ROLLOUT_TP=2\n" in script
    assert "export NCCL_IB_HCA=mlx5" in script
    assert "--index $((FIRST_INDEX + SLURM_PROCID))" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0
    assert "    sleep 5 &\n" in script  # cluster.satellite_watch_s
    assert "    sleep 1 &\n" in render_satellite(planned_job(satellite_watch_s=1), tmp_path, "1", 1)[0]
    with pytest.raises(ValueError, match="cluster.satellite_watch_s must be >= 1"):
        planned_job(satellite_watch_s=0)


def test_fresh_indices_are_never_reused(tmp_path) -> None:
    job = dataclasses.replace(
        planned_job(), rollout=dataclasses.replace(planned_job().rollout, num_servers=3)
    )
    assert next_index(job, tmp_path, []) == 3
    discovery.register_server(tmp_path, 5, "127.0.0.1", 1005)
    assert next_index(job, tmp_path, []) == 6
    discovery.unregister_server(tmp_path, 5)
    discovery.request_drain(tmp_path, 5)  # drained and gone: its index stays taken
    assert next_index(job, tmp_path, []) == 6
    assert next_index(job, tmp_path, [Satellite("9", 6, 4)]) == 10


def test_satellites_round_trip_and_shrink_refuses_the_jobs_own_nodes(tmp_path) -> None:
    assert read_satellites(tmp_path) == []
    write_satellites(tmp_path, [Satellite("17", 3, 1)])
    assert read_satellites(tmp_path) == [Satellite("17", 3, 1)]
    assert json.loads((tmp_path / "satellites.json").read_text()) == [
        {"job_id": "17", "first_index": 3, "num_servers": 1}
    ]
    with pytest.raises(ValueError, match="only rollout nodes added by launch.scale"):
        scale_slurm.shrink(tmp_path, 2, drain_timeout_s=1)
    assert not (tmp_path / "servers").exists()  # refused before any drain marker


def test_scale_cli_on_a_slurm_run_that_has_not_started(tmp_path, capsys) -> None:
    save_job_config(planned_job(), tmp_path / "config.yaml")
    with pytest.raises(SystemExit):
        main([str(tmp_path), "+1"])
    assert "has not started yet" in capsys.readouterr().err
    assert scale_slurm.rollout_nodes(tmp_path) == plan_job(planned_job()).rollout_nodes
