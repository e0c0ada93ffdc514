"""Small-cluster renders (sbatch/small_{1,2,3}x8.sbatch): one job over whole nodes, every step
pinned to its GPUs. The golden diff itself is in test_launch_render.py; here, what the script
must say for the 1 x 8 split (6 + 2) and the 3 x 8 split (18 + 6), and that bash parses it."""

from __future__ import annotations

import subprocess

import pytest

from launch.slurm import golden


@pytest.fixture(scope="module")
def renders() -> dict[str, str]:
    return {name: golden.render_reference(name) for name in ("small_1x8", "small_2x8", "small_3x8")}


def test_one_node_split_pins_servers_and_trainer(renders) -> None:
    text = renders["small_1x8"]
    assert "#SBATCH hetjob" not in text
    assert "#SBATCH --nodes=1 --ntasks-per-node=8 --cpus-per-task=12 --gres=gpu:8 --exclusive" in text
    assert "export TRAINER_GPUS=6,7 " in text
    assert "--distribution=arbitrary --ntasks=6 --overlap --job-name=areal-rollout-servers" in text
    assert 'awk -v whole=0 -v full="$SERVERS_PER_NODE" -v shared=6' in text
    assert (
        'trainer.hosts" srun --distribution=arbitrary --ntasks=2 --overlap --job-name=areal-trainer' in text
    )
    assert 'awk -v first=2 -v full="$TRAINER_TASKS_PER_NODE"' in text
    assert "--het-group" not in text


def test_three_nodes_split_eighteen_and_six(renders) -> None:
    text = renders["small_3x8"]
    assert "GPU-level split 18 + 6" in text
    assert "#SBATCH --nodes=3 " in text
    assert (
        "export TRAINER_GPUS=2,3,4,5,6,7 " in text and "--ntasks=6 --overlap --job-name=areal-trainer" in text
    )
    assert 'awk -v whole=2 -v full="$SERVERS_PER_NODE" -v shared=2' in text
    assert "ports 30000-30017" in text  # 18 servers


def hostfiles(text: str, nodes: list[str], tmp_path) -> tuple[list[str], list[str]]:
    """Run the rendered layout block with a stand-in `scontrol`: (rollout.hosts, trainer.hosts)."""
    start = text.index("# gpus placement:")
    block = text[start : text.index('log "start on', start)]
    (tmp_path / "scontrol").write_text("#!/bin/sh\nprintf '%s\\n' " + " ".join(nodes) + "\n")
    (tmp_path / "scontrol").chmod(0o755)
    env = f"export PATH={tmp_path}:$PATH SERVERS_PER_NODE=8 TRAINER_TASKS_PER_NODE=8 RUN_DIR={tmp_path}\n"
    subprocess.run(["bash", "-euc", env + "SLURM_JOB_NODELIST=x\n" + block], check=True)
    return (tmp_path / "rollout.hosts").read_text().split(), (tmp_path / "trainer.hosts").read_text().split()


def test_hostfiles_put_each_task_on_its_node(renders, tmp_path) -> None:
    servers, trainer = hostfiles(renders["small_3x8"], ["n1", "n2", "n3"], tmp_path)
    assert servers == ["n1"] * 8 + ["n2"] * 8 + ["n3"] * 2 and trainer == ["n3"] * 6


def test_trainer_over_the_shared_node_and_a_whole_node(tmp_path) -> None:
    """4 x 8 at 21/32 (the simulator's best split for 32 GPUs): 21 servers + 11 trainer ranks."""
    from launch.slurm.submit import prepare

    job = golden_job(["cluster.nodes=4", "cluster.rollout_fraction=0.65625"])
    text = prepare(job, cwd=golden.WORKDIR, python=golden.PYTHON).script
    assert "export TRAINER_GPUS=5,6,7 " in text and "--ntasks=11 --overlap --job-name=areal-trainer" in text
    servers, trainer = hostfiles(text, ["n1", "n2", "n3", "n4"], tmp_path)
    assert servers == ["n1"] * 8 + ["n2"] * 8 + ["n3"] * 5
    assert trainer == ["n3"] * 3 + ["n4"] * 8


def golden_job(extra: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from areal_jobs.config import register_configs, to_job_config

    register_configs()
    GlobalHydra.instance().clear()
    overrides = ["experiment=math_qwen2_1p5b", *golden.COMMON_OVERRIDES, *extra]
    with initialize_config_dir(config_dir=str(golden.CONF_DIR), version_base="1.3"):
        return to_job_config(compose(config_name="submit", overrides=overrides))


@pytest.mark.parametrize("name", ["small_1x8", "small_2x8", "small_3x8"])
def test_bash_parses_the_render(renders, name) -> None:
    subprocess.run(["bash", "-n"], input=renders[name], text=True, check=True)
