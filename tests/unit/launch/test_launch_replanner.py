"""The re-planner beside a job (launch/run/replanner.py): what it reads from the metrics rows, by hand;
the recommendation it logs for a measurement that needs more rollout, less, or none; autoscale
through launch.local's scale.json; the SLURM re-planner's advice."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from areal_jobs.config import (
    ClusterConfig,
    JobConfig,
    RolloutConfig,
    register_configs,
    save_job_config,
    to_job_config,
)
from areal_jobs.data.answer_lengths import LengthStats
from areal_jobs.metrics import read_jsonl
from launch.run.elastic import read_target
from launch.run.replanner import (
    PoolShape,
    Replanner,
    RunMetrics,
    job_profile,
    local_replanner,
    main,
    measure,
    slurm_shape,
)
from launch.slurm import satellites as scale_slurm

CONF = str(Path(__file__).resolve().parents[3] / "conf")
GROUPS = ((10, 10), (1000, 1000))  # median exp((ln 10 + ln 1000) / 2) = 100 tokens
SHAPE = PoolShape(trainer_nodes=2, trainer_gpus=2, gpus_per_node=1, servers_per_node=1, gpus_per_server=1)


def row(
    step: int, gen: float, in_flight: float, servers: float, train: float, publish_s: float = 0.5
) -> dict:
    return {
        "step": step,
        "train/version": float(step),
        "rollout/gen_tokens_per_s": gen,
        "rollout/requests_in_flight": in_flight,
        "rollout/servers_up": servers,
        "throughput/train_tokens_per_s": train,
        "time/publish_s": publish_s,
        "gen/prompt_len_mean": 30.0,
        **LengthStats.of_groups(GROUPS).metrics(),
    }


def test_measure_by_hand():
    rows = [
        row(1, 400.0, 8.0, 2.0, 1000.0, 0.5),
        row(2, 0.0, 0.0, 2.0, 3000.0, 1.5),
        {"step": 2, "eval/k": 1.0},
    ]
    m = measure(rows, 0.5, SHAPE)
    assert m.rollout_fraction == 0.5
    # step 2 generated nothing (paused for the update): only step 1 measures decode, 400 / 2 servers
    assert (m.gen_tokens_per_s_per_gpu, m.gen_batch_per_gpu) == (200.0, 4.0)
    assert m.train_tokens_per_s_per_gpu == (1000.0 + 3000.0) / 2 / 2  # per trainer GPU
    assert (m.weight_sync_s, m.prompt_tokens) == (1.0, 30.0)
    assert math.exp(m.lengths.log_mean) == pytest.approx(100.0)
    # all the spread is between prompts: their means lie ln 10 either side of ln 100
    assert m.lengths.prompt_var == pytest.approx(math.log(10) ** 2)
    assert measure([row(1, 0.0, 0.0, 2.0, 1000.0)], 0.5, SHAPE) is None  # no generation measured


def replanner(tmp_path: Path, nodes: int, every: int = 2, act=None, **cluster) -> Replanner:
    job = JobConfig(cluster=ClusterConfig(**cluster))
    return Replanner(
        job_profile(job, SHAPE), SHAPE, every, lambda: nodes, RunMetrics(tmp_path / "metrics.jsonl"),
        job.cluster, act,
    )  # fmt: skip


# (servers now, decode tok/s and batch per server, train tok/s) -> the split the planner should move to
SLOW_GEN = (50.0, 4.0, 2e6)  # the trainer waits for generation
SLOW_TRAIN = (4000.0, 32.0, 200.0)  # generation waits for the trainer
BALANCED = (500.0, 8.0, 3000.0)  # 2 of 4 nodes stay best for train speeds 1500-6000 tok/s


@pytest.mark.parametrize(
    "nodes, measured, direction",
    [(2, SLOW_GEN, "more"), (2, SLOW_TRAIN, "less"), (2, BALANCED, "none")],
)
def test_recommendation_follows_the_bottleneck(tmp_path, nodes, measured, direction):
    gen, batch, train = measured
    r = replanner(tmp_path, nodes)
    r.observe([row(s, gen * nodes, batch * nodes, nodes, train) for s in (1, 2, 3)])
    rec, decision = r.last
    assert decision is None  # autoscale off
    now = nodes / (nodes + 2)
    assert rec.current_fraction == now
    if direction == "more":
        assert rec.rollout_fraction > now and rec.expected_gain > 1.0
    elif direction == "less":
        assert rec.rollout_fraction < now and rec.expected_gain > 1.0
    else:
        assert rec.rollout_fraction == now and rec.expected_gain == 1.0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 1 and rows[0]["step"] == 2  # one window of 2 steps; step 3 waits for the next
    assert rows[0]["plan/recommended_rollout_fraction"] == rec.rollout_fraction
    assert rows[0]["plan/expected_gain"] == rec.expected_gain
    assert rows[0]["plan/gen_tokens_per_s_per_gpu"] == gen
    assert rows[0]["plan/answer_median_tokens"] == pytest.approx(100.0)


def test_autoscale_decides_only_on_a_settled_pool(tmp_path, caplog):
    acted = []
    r = replanner(tmp_path, 2, act=acted.append, autoscale=True, autoscale_max_nodes=4)
    gen, batch, train = SLOW_GEN
    with caplog.at_level(logging.INFO, logger="launch.run.replanner"):
        r.observe([row(s, gen * 3, batch * 3, 3.0, train) for s in (1, 2)])  # 3 up, 2 asked: changing
    assert acted == [] and r.last[1] is None and "the pool is changing" in caplog.text
    r.observe([row(s, gen * 2, batch * 2, 2.0, train) for s in (3, 4)])
    (d,) = acted
    assert d.current_nodes == 2 and 2 < d.target_nodes <= 4 and d.expected_gain >= 1.1
    assert read_jsonl(tmp_path / "metrics.jsonl")[-1]["plan/autoscale_target_nodes"] == d.target_nodes


@pytest.mark.parametrize("servers, measured, grows", [(1, SLOW_GEN, True), (3, SLOW_TRAIN, False)])
def test_local_autoscale_writes_the_scale_request(tmp_path, servers, measured, grows):
    job = JobConfig(
        rollout=RolloutConfig(num_servers=servers),
        cluster=ClusterConfig(replan_every_steps=2, autoscale=True, autoscale_max_nodes=3),
    )
    r = local_replanner(job, tmp_path)
    assert r.shape.trainer_nodes == 1  # the torch trainer: one rank
    gen, batch, train = measured
    r.observe([row(s, gen * servers, batch * servers, servers, train) for s in (1, 2)])
    target = read_target(tmp_path)
    assert target is not None and (servers < target <= 3 if grows else 1 <= target < servers)
    assert local_replanner(JobConfig(cluster=ClusterConfig(replan_every_steps=0)), tmp_path) is None


def test_autoscale_config_names_the_override():
    with pytest.raises(ValueError, match="cluster.autoscale_max_nodes=N"):
        ClusterConfig(autoscale=True)
    with pytest.raises(ValueError, match="cluster.replan_every_steps=20"):
        ClusterConfig(autoscale=True, autoscale_max_nodes=2, replan_every_steps=0)
    with pytest.raises(ValueError, match="cluster.autoscale_min_gain"):
        ClusterConfig(autoscale_min_gain=-1.0)
    with pytest.raises(ValueError, match="cluster.replan_every_steps"):
        ClusterConfig(replan_every_steps=-1)
    with pytest.raises(ValueError, match="rollout.num_servers=3"):
        JobConfig(
            rollout=RolloutConfig(num_servers=3), cluster=ClusterConfig(autoscale=True, autoscale_max_nodes=2)
        )


ROLLOUT_BOUND = str(Path(__file__).resolve().parents[2] / "fixtures" / "sim" / "rollout_bound.yaml")


def slurm_job(*overrides: str) -> JobConfig:
    register_configs()
    small = [
        "cluster.nodes=8",
        "algo.batch_size=16",
        "algo.group_size=4",
        f"cluster.allocation_profile={ROLLOUT_BOUND}",
    ]
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return to_job_config(compose("config", overrides=["experiment=math_qwen2_1p5b", *small, *overrides]))


@pytest.mark.parametrize("satellites", [0, 1, 2])
def test_slurm_autoscale_acts_through_satellite_jobs(tmp_path, caplog, monkeypatch, satellites):
    job = slurm_job(
        "cluster.replan_every_steps=2", "cluster.autoscale=true", "cluster.autoscale_max_nodes=10"
    )
    shape, nodes = slurm_shape(job)
    assert (nodes, shape.trainer_nodes, shape.servers_per_node) == (6, 2, 8)  # 8 x 8 GPUs, fraction 0.75
    save_job_config(job, tmp_path / "config.yaml")
    # the pool the rows ran: the job's 6 rollout nodes and its satellites
    scale_slurm.write_satellites(
        tmp_path, [scale_slurm.Satellite(str(40 + k), 48 + 8 * k, 8) for k in range(satellites)]
    )
    servers = (nodes + satellites) * shape.servers_per_node
    rows = [row(s, 300.0 * servers, 4.0 * servers, servers, 8000.0 * shape.trainer_gpus) for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text("{}")
    calls = []
    monkeypatch.setattr(scale_slurm, "grow", lambda run_dir, n: calls.append(+n))
    monkeypatch.setattr(scale_slurm, "shrink", lambda run_dir, n, timeout_s: calls.append(-n))
    monkeypatch.setattr("areal_jobs.logs.setup_logging", lambda role: None)  # keep caplog's handler
    with caplog.at_level(logging.INFO, logger="launch.run.replanner"):
        assert main([str(tmp_path), "--from-start", "--poll-s", "0"]) == 0
    plan = read_jsonl(tmp_path / "metrics.jsonl")[-1]
    assert "plan/recommended_rollout_fraction" in plan
    target, current = int(plan["plan/autoscale_target_nodes"]), nodes + satellites
    assert target != current, caplog.text  # a change (which way is the simulator's answer)
    if target > current:
        assert calls == [target - current]
    else:  # only satellite nodes can be released
        released = min(current - target, satellites)
        assert calls == ([-released] if released else [])
        assert ("only satellites can be released" in caplog.text) == (released < current - target)
    if calls:
        assert f"make scale RUN={tmp_path} ROLLOUT_NODES={calls[0]:+d}" in caplog.text


def test_plan_rows_land_in_the_file_a_resuming_trainer_rewrote(tmp_path):
    from areal_jobs.checkpoint import truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "reward/mean": 0.0}) + "\n" + json.dumps({"step": 9}) + "\n")
    r = local_replanner(JobConfig(cluster=ClusterConfig(replan_every_steps=2)), tmp_path)
    truncate_jsonl(path, 1)  # the trainer resumes from step 1 after the launcher built its re-planner
    r.observe([row(s, 100.0, 4.0, 1.0, 1000.0) for s in (2, 3)])
    steps = [(x["step"], "plan/expected_gain" in x) for x in read_jsonl(path)]
    assert steps == [(1, False), (3, True)]
