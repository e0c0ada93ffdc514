"""Small-cluster renders (sbatch/small_{1,2,3}x8.sbatch): one job over whole nodes, every step
pinned to its GPUs. The golden diff itself is in test_launch_render.py; here, what the script
must say for the 1 x 8 split (6 + 2) and the 3 x 8 split (18 + 6), and that bash parses it."""

from __future__ import annotations

import subprocess

import pytest

from launch import golden


@pytest.fixture(scope="module")
def renders() -> dict[str, str]:
    return {name: golden.render_reference(name) for name in ("small_1x8", "small_2x8", "small_3x8")}


def test_one_node_split_pins_servers_and_trainer(renders) -> None:
    text = renders["small_1x8"]
    assert "#SBATCH hetjob" not in text
    assert "#SBATCH --nodes=1 --ntasks-per-node=8 --cpus-per-task=12 --gres=gpu:8 --exclusive" in text
    assert "export TRAINER_GPUS=6,7 " in text
    assert "--distribution=arbitrary --ntasks=6 --overlap --job-name=areal-rollout-servers" in text
    assert 'awk -v last=1 -v full="$SERVERS_PER_NODE" -v shared=6' in text
    assert '--ntasks="$TRAINER_TASKS_PER_NODE" --nodelist="$TRAINER_HEAD" --overlap' in text
    assert "TRAINER_TASKS_PER_NODE=2\n" in text
    assert "--het-group" not in text


def test_three_nodes_split_eighteen_and_six(renders) -> None:
    text = renders["small_3x8"]
    assert "GPU-level split 18 + 6" in text
    assert "#SBATCH --nodes=3 " in text
    assert "export TRAINER_GPUS=2,3,4,5,6,7 " in text and "TRAINER_TASKS_PER_NODE=6\n" in text
    assert 'awk -v last=3 -v full="$SERVERS_PER_NODE" -v shared=2' in text
    assert "ports 30000-30017" in text  # 18 servers


def test_hostfile_lines_put_each_server_on_its_node(renders, tmp_path) -> None:
    """Run the rendered hostfile lines with a stand-in `scontrol`: 8 + 8 + 2 lines for 3 x 8."""
    text = renders["small_3x8"]
    start = text.index('scontrol show hostnames "$SLURM_JOB_NODELIST" \\')
    block = text[start : text.index('rollout.hosts"', start) + len('rollout.hosts"')]
    (tmp_path / "scontrol").write_text("#!/bin/sh\nprintf 'n1\\nn2\\nn3\\n'\n")
    (tmp_path / "scontrol").chmod(0o755)
    script = f"PATH={tmp_path}:$PATH SERVERS_PER_NODE=8 RUN_DIR={tmp_path} SLURM_JOB_NODELIST=x\n{block}\n"
    subprocess.run(["bash", "-c", script.replace("\n    |", " |").replace("\\\n", "")], check=True)
    lines = (tmp_path / "rollout.hosts").read_text().split()
    assert lines == ["n1"] * 8 + ["n2"] * 8 + ["n3"] * 2


@pytest.mark.parametrize("name", ["small_1x8", "small_2x8", "small_3x8"])
def test_bash_parses_the_render(renders, name) -> None:
    subprocess.run(["bash", "-n"], input=renders[name], text=True, check=True)
