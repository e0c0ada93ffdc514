"""GPU-level placement on the loopback SLURM cluster (issue 14): one job, nodes shared by roles.

With stand-in roles (fake_roles.py, seconds): the rendered split puts every server on its node
and GPU and the trainer on the remaining GPU of the last node. With the real roles: a one-node
split (2 fake GPUs: one CPU SGLang server on GPU 0, the torch trainer on GPU 1) trains end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from local_slurm import LocalSlurm, local_port_overrides
from test_slurm_hetjob import _snapshot, submit
from test_slurm_pipeline import JOB_TIMEOUT_S, dump_logs, lean_overrides, make_submit

from areal_jobs.metrics import read_jsonl

pytestmark = pytest.mark.slurm


@pytest.mark.parametrize(
    ("nodes", "gpus_per_node", "servers", "trainer"),
    [
        # 1 x 4 GPUs at 0.75: servers on GPUs 0, 1, 2 of n1, the trainer on GPU 3 of n1
        (1, 4, [("n1", "0"), ("n1", "1"), ("n1", "2")], ("n1", "3")),
        # 2 x 2 GPUs at 0.75: 3 rollout GPUs = both of n1 + GPU 0 of n2; the trainer on GPU 1 of n2
        (2, 2, [("n1", "0"), ("n1", "1"), ("n2", "0")], ("n2", "1")),
    ],
    ids=["1x4", "2x2"],
)
def test_split_pins_every_role_to_its_gpus(
    slurm_cluster: LocalSlurm, tmp_path: Path, nodes: int, gpus_per_node: int, servers: list, trainer: tuple
) -> None:
    job_id, run_dir = submit(
        slurm_cluster,
        tmp_path,
        f"split{nodes}x{gpus_per_node}",
        "trainer.total_steps=3",
        f"cluster.nodes={nodes}",
        f"cluster.gpus_per_node={gpus_per_node}",
    )
    assert slurm_cluster.wait_until_done(job_id, timeout_s=120) == ["COMPLETED"]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["rollout"]["num_servers"] == 3
    placed = []
    for index in range(3):
        env = _snapshot(run_dir, f"server{index}")
        placed.append((env["SLURMD_NODENAME"], env["CUDA_VISIBLE_DEVICES"]))
    assert placed == servers
    rank0 = _snapshot(run_dir, "trainer0")
    assert (rank0["SLURMD_NODENAME"], rank0["CUDA_VISIBLE_DEVICES"]) == trainer
    assert (rank0["RANK"], rank0["WORLD_SIZE"]) == ("0", "1")
    assert _snapshot(run_dir, "controller")["SLURMD_NODENAME"] == trainer[0]


def test_trainer_spans_the_shared_node_and_a_whole_node(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    # 2 x 4 GPUs at 3/8: servers on GPUs 0-2 of n1; 5 trainer ranks: GPU 3 of n1, then all of n2
    job_id, run_dir = submit(
        slurm_cluster,
        tmp_path,
        "span",
        "trainer=fsdp",  # the fake roles ignore it; the planner needs a multi-rank backend for 5 GPUs
        "trainer.total_steps=3",
        "cluster.nodes=2",
        "cluster.gpus_per_node=4",
        "cluster.rollout_fraction=0.375",
    )
    assert slurm_cluster.wait_until_done(job_id, timeout_s=120) == ["COMPLETED"]
    servers = [_snapshot(run_dir, f"server{i}") for i in range(3)]
    assert [(e["SLURMD_NODENAME"], e["CUDA_VISIBLE_DEVICES"]) for e in servers] == [
        ("n1", "0"),
        ("n1", "1"),
        ("n1", "2"),
    ]
    ranks = [_snapshot(run_dir, f"trainer{r}") for r in range(5)]
    assert {r["WORLD_SIZE"] for r in ranks} == {"5"}
    assert (ranks[0]["SLURMD_NODENAME"], ranks[0]["CUDA_VISIBLE_DEVICES"], ranks[0]["LOCAL_RANK"]) == (
        "n1",
        "3",
        "0",
    )
    assert [(r["SLURMD_NODENAME"], r["LOCAL_RANK"]) for r in ranks[1:]] == [("n2", str(i)) for i in range(4)]
    assert all(r["CUDA_VISIBLE_DEVICES"] != "3" for r in ranks[1:])  # not pinned to n1's trainer GPU


@pytest.mark.sglang
@pytest.mark.slow
def test_one_node_split_trains_end_to_end(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    overrides = [
        *lean_overrides(tmp_path, "onenode", total_steps=2),
        "cluster.nodes=1",
        "cluster.gpus_per_node=2",
        *local_port_overrides(1),  # later keys win: ports for the one server
    ]
    job_id = make_submit(slurm_cluster, overrides)
    run_dir = tmp_path / "runs" / "onenode"
    states = slurm_cluster.wait_until_done(job_id, timeout_s=JOB_TIMEOUT_S)
    assert states == ["COMPLETED"], dump_logs(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["trained_tokens"] > 0
    assert sum("train/version" in row for row in read_jsonl(run_dir / "metrics.jsonl")) == 2
    logs = run_dir / "logs"
    assert "sglang.launch_server" in (logs / "sglang-0.log").read_text()
    assert "final: " in (logs / "trainer-0.log").read_text()
    sbatch = (logs / f"sbatch-{job_id}.out").read_text()
    assert "trainer exited with 0" in sbatch and "trainer nodes n1" in sbatch
    assert slurm_cluster.leftover_job_processes() == []
