"""The sbatch renderer: header structure, srun lines, quoting, errors, and the committed renders."""

from __future__ import annotations

import dataclasses
import re
import subprocess

import pytest

from areal_jobs.config import (
    AlgoConfig,
    ClusterConfig,
    ClusterKind,
    JobConfig,
    RunConfig,
    TrainerBackend,
    TrainerConfig,
)
from launch.planning.layout.plan import apply_plan, plan_job
from launch.slurm import golden
from launch.slurm.render import render_sbatch

WORKDIR = "/shared/areal_jobs"


def make_job(**cluster) -> JobConfig:
    fields = {"kind": ClusterKind.slurm, "nodes": 64, "workdir": WORKDIR, "python": "python3", **cluster}
    return JobConfig(
        run=RunConfig(name="exp", root="runs"),
        cluster=ClusterConfig(**fields),
        trainer=TrainerConfig(backend=TrainerBackend.megatron),
        algo=AlgoConfig(batch_size=64, group_size=8),
    )


def render(job: JobConfig) -> str:
    plan = plan_job(job)
    return render_sbatch(apply_plan(job, plan), plan)


def sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


@pytest.mark.parametrize("experiment", sorted(golden.REFERENCES))
def test_committed_render_matches(experiment: str) -> None:
    diff = golden.diff_against_golden(experiment)
    assert not diff, f"sbatch/{experiment}.sbatch is stale: run `make golden` and review\n{diff}"


def test_header_is_one_heterogeneous_job_with_two_components() -> None:
    script = render(make_job(partition="h800", account="rl", qos="high", requeue_signal_s=600))
    lines = sbatch_lines(script)
    assert lines.count("#SBATCH hetjob") == 1
    first, second = "\n".join(lines).split("#SBATCH hetjob")
    assert "--nodes=48 --ntasks-per-node=8 --cpus-per-task=8 --gres=gpu:8 --exclusive" in first
    assert "--nodes=16 --ntasks-per-node=8 --cpus-per-task=8 --gres=gpu:8 --exclusive" in second
    for part in (first, second):
        for option in ("--partition=h800", "--account=rl", "--qos=high", "--time=24:00:00"):
            assert f"#SBATCH {option}" in part
    for option in ("--signal=B:USR1@600", "--requeue", "--open-mode=append", f"--chdir={WORKDIR}"):
        assert f"#SBATCH {option}" in first
    assert f"#SBATCH --output={WORKDIR}/runs/exp/logs/sbatch-%j.out" in first


def test_sbatch_directives_precede_the_first_command() -> None:
    # sbatch stops reading #SBATCH lines at the first line that is neither blank nor a comment
    lines = render(make_job()).splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    assert max(i for i, line in enumerate(lines) if line.startswith("#SBATCH")) < first_command


def test_script_is_valid_bash() -> None:
    proc = subprocess.run(
        ["bash", "-n"], input=render(make_job()), text=True, capture_output=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_srun_lines_start_each_role_in_its_group() -> None:
    script = render(make_job())
    sruns = re.findall(r"^srun .*?' &$", script, re.MULTILINE | re.DOTALL)
    assert len(sruns) == 3
    servers, controller, trainer = sruns
    assert (
        "--het-group=0" in servers
        and "areal_jobs.rollout.supervise" in servers
        and '--index "$SLURM_PROCID"' in servers
    )
    assert "--het-group=1" in controller and "areal_jobs.rollout.main" in controller
    assert (
        '--nodelist="$TRAINER_HEAD"' in controller
        and "--overlap" in controller
        and "--gres=none" in controller
    )
    assert "--het-group=1" in trainer and "areal_jobs.trainer.main" in trainer
    assert "RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID" in trainer
    assert "SERVERS_PER_NODE=8\n" in script and "TRAINER_TASKS_PER_NODE=8\n" in script
    for srun in sruns:  # every role binds a reachable address: its node's hostname off loopback
        assert "export AREAL_BIND_HOST=${AREAL_BIND_HOST:-$(hostname)}" in srun


def test_discovery_token_and_trap_are_in_the_script() -> None:
    script = render(make_job())
    assert "TRAINER_NODELIST=$SLURM_JOB_NODELIST_HET_GROUP_1" in script
    assert 'scontrol show hostnames "$TRAINER_NODELIST"' in script
    assert 'export MASTER_ADDR="$CONTROLLER_HOST" MASTER_PORT=29500' in script
    assert "/dev/urandom" in script and "umask 077" in script and "export AREAL_JOB_TOKEN" in script
    assert "trap on_usr1 USR1" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert "LOOPBACK=0\n" in script and "LOOPBACK=1\n" in render(make_job(nodes=4, loopback=True))


def test_the_node_check_interval_is_the_configs() -> None:
    assert "    sleep 10 &\n" in render(make_job())  # the default
    assert "    sleep 2 &\n" in render(make_job(node_check_s=2))
    with pytest.raises(ValueError, match="cluster.node_check_s must be >= 1"):
        make_job(node_check_s=0)


def test_nccl_env_is_sorted_and_quoted() -> None:
    script = render(make_job(nccl_env={"NCCL_SOCKET_IFNAME": "bond0", "NCCL_IB_HCA": "mlx5_0 mlx5_1; rm"}))
    exports = [line for line in script.splitlines() if line.startswith("export NCCL_")]
    assert exports == ["export NCCL_IB_HCA='mlx5_0 mlx5_1; rm'", "export NCCL_SOCKET_IFNAME=bond0"]


def test_optional_pieces_appear_only_when_set() -> None:
    bare = render(make_job())
    assert "--container-image" not in bare and "--account" not in bare and "--mem=" not in bare
    assert "#SBATCH --signal" not in render(make_job(requeue_signal_s=0))
    full = render(
        make_job(
            container_image="/img.sqsh",
            container_mounts="/shared:/shared",
            mem_per_node="1800G",
            sbatch_args=["--constraint=h800"],
        )
    )
    assert full.count("--container-image=/img.sqsh --container-workdir=/shared/areal_jobs") == 3
    assert full.count("--container-mounts=/shared:/shared") == 3
    assert full.count("--gres=gpu:8 --exclusive --mem=1800G") == 2
    assert full.count("#SBATCH --constraint=h800") == 2


def test_paths_with_spaces_are_quoted() -> None:
    script = render(make_job(workdir="/shared/my runs", python="/opt/py 3/bin/python"))
    assert "export RUN_DIR='/shared/my runs/runs/exp'" in script
    assert "export PYTHON='/opt/py 3/bin/python'" in script


def test_rendering_is_deterministic() -> None:
    assert render(make_job()) == render(make_job())


@pytest.mark.parametrize(
    ("cluster", "name"),
    [({"workdir": "relative/dir"}, "cluster.workdir"), ({"python": ""}, "cluster.python")],
)
def test_unresolved_paths_are_rejected(cluster: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        render(make_job(**cluster))


def test_template_errors_are_loud() -> None:
    job = make_job()
    plan = plan_job(job)
    template = golden.REPO.joinpath("sbatch/hetjob.sbatch.tmpl").read_text()
    with pytest.raises(ValueError, match="Invalid placeholder"):
        render_sbatch(job, plan, template=template + "{{ 9lives }}\n")
    with pytest.raises(KeyError, match="unknown_value"):
        render_sbatch(job, plan, template=template + "{{ unknown_value }}\n")
    with pytest.raises(ValueError, match="lacks placeholders"):
        render_sbatch(job, plan, template="#!/bin/bash\n{{ sbatch_header }}\n")
    # bash's own ${VAR} and $((...)) pass through untouched
    bash = 'echo "${X:-$((1 + 2))}"\n'
    assert render_sbatch(job, plan, template=template + bash).endswith(bash)


def test_absolute_run_root_is_used_as_is() -> None:
    job = make_job()
    job = dataclasses.replace(job, run=RunConfig(name="exp", root="/scratch/runs"))
    assert "export RUN_DIR=/scratch/runs/exp" in render(job)


def test_the_job_starts_the_replanner_only_where_it_can_count_whole_nodes() -> None:
    assert 'if [ 1 = 1 ]; then\n    "$PYTHON" -m launch.run.replanner' in render(make_job())
    assert "if [ 0 = 1 ]; then" in render(make_job(replan_every_steps=0))
    assert "if [ 0 = 1 ]; then" in render(make_job(nodes=2, gpus_per_node=8, placement="gpus"))


@pytest.mark.parametrize(
    ("cluster", "no_kill"),
    [
        ({}, True),  # 48 rollout + 16 trainer nodes
        ({"nodes": 4, "gpus_per_node": 1, "rollout_fraction": "0.5"}, True),  # 2 + 2
        ({"nodes": 4, "gpus_per_node": 1, "rollout_fraction": "0.75"}, False),  # 3 + 1: a 1-node trainer
        ({"nodes": 2, "gpus_per_node": 1, "rollout_fraction": "0.5"}, False),  # 1 + 1
        ({"nodes": 2, "placement": "gpus"}, False),  # one job split per GPU
    ],
)
def test_no_kill_only_where_both_het_groups_can_lose_a_node(cluster, no_kill) -> None:
    script = render(make_job(**cluster))
    assert sbatch_lines(script).count("#SBATCH --no-kill") == (2 if no_kill else 0)
    assert f"NODE_LOSS={int(no_kill)}\n" in script
