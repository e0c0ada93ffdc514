"""launch/slurm/aux_jobs.py: a run's cluster settings become submitit parameters (pure part)."""

from __future__ import annotations

import pytest

from areal_jobs.config import ClusterConfig
from launch.slurm.aux_jobs import executor_parameters, main


def test_bare_cluster_gives_only_the_shape() -> None:
    params = executor_parameters(
        ClusterConfig(cpus_per_task=4), name="eval", nodes=1, gpus_per_node=8, timeout_min=30
    )
    assert params == {
        "name": "eval",
        "nodes": 1,
        "tasks_per_node": 1,
        "cpus_per_task": 4,
        "gpus_per_node": 8,
        "timeout_min": 30,
    }


def test_site_settings_and_container_are_carried_over() -> None:
    cluster = ClusterConfig(
        partition="h800",
        account="rl",
        qos="high",
        mem_per_node="1800G",
        sbatch_args=["--constraint=h800", "--exclusive"],
        container_image="/img.sqsh",
        container_mounts="/shared:/shared",
    )
    params = executor_parameters(cluster, name="convert", nodes=2, gpus_per_node=8, timeout_min=60)
    assert (params["slurm_partition"], params["slurm_account"], params["slurm_qos"]) == ("h800", "rl", "high")
    assert params["slurm_mem"] == "1800G"
    assert params["slurm_additional_parameters"] == {"constraint": "h800", "exclusive": True}
    assert params["slurm_srun_args"] == ["--container-image=/img.sqsh", "--container-mounts=/shared:/shared"]


def test_cli_needs_a_command(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--run-dir", str(tmp_path)])
    assert "give the command after --" in capsys.readouterr().err
