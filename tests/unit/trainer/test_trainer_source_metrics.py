"""Per-source figures on the trainer's side: the source travels with its group over the wire, the
batch metrics carry source/<name>/..., every evaluation logs eval/<name>/accuracy, and
summary.json's by_source has a row per source (start and end accuracy, last training batches)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
from test_trainer_batch import group

from areal_jobs.config import AlgoConfig
from areal_jobs.trainer.intake.batch import assemble
from areal_jobs.trainer.loop import TrainLoop
from areal_jobs.trainer.session import by_source
from areal_jobs.transport import codec
from areal_jobs.transport import messages as m


def test_the_source_crosses_the_wire_with_its_group():
    g = dataclasses.replace(group("g1", [[0], [0, 0]], [1.0, 0.0]), source="easy")
    assert codec.decode_group(codec.encode_group(g, "t"), "t").source == "easy"
    plain = group("g2", [[0]], [1.0])
    assert codec.decode_group(codec.encode_group(plain, "t"), "t").source == ""


def test_batch_metrics_have_a_block_per_source():
    groups = [
        dataclasses.replace(group("g1", [[0], [0, 0, 0]], [1.0, 0.0], finish={1: "length"}), source="easy"),
        dataclasses.replace(group("g2", [[0, 0], [0, 0]], [1.0, 1.0]), source="hard"),
    ]
    algo = AlgoConfig(batch_size=2, group_size=2)
    batch = assemble(groups, trainer_version=0, algo=algo)
    loop = SimpleNamespace(trained_tokens=0, max_staleness_seen=0, algo=algo)
    got = TrainLoop._batch_metrics(loop, batch, groups)
    assert {k: v for k, v in got.items() if k.startswith("source/easy/")} == {
        "source/easy/reward": 0.5,
        "source/easy/accuracy": 0.5,
        "source/easy/length": 2.0,
        "source/easy/truncated": 0.5,
        "source/easy/samples": 2.0,
    }
    assert got["source/hard/accuracy"] == 1.0 and got["source/hard/length"] == 2.0


class Sink:
    def __init__(self):
        self.rows = []

    def log(self, step, row):
        self.rows.append((step, row))


def evals():
    return [
        m.EvalResult(0, 0.3, 0.3, 7, "start", by_source={"easy": 0.5, "hard": 0.0}, source_sizes={"easy": 4, "hard": 3}),
        m.EvalResult(0, 0.4, 0.4, 7, "start_greedy", by_source={"easy": 0.75, "hard": 0.0}),
        m.EvalResult(9, 0.6, 0.6, 7, "final", by_source={"easy": 1.0, "hard": 0.25}, source_sizes={"easy": 4, "hard": 3}),
    ]  # fmt: skip


def test_every_evaluation_logs_accuracy_per_source():
    pending = evals()
    loop = SimpleNamespace(inbox=SimpleNamespace(take_evals=lambda: pending), sink=Sink(), step=3)
    TrainLoop.log_evals(loop)
    (_, start), (_, greedy), (_, final) = loop.sink.rows
    assert (start["eval/easy/accuracy"], start["eval/hard/accuracy"]) == (0.5, 0.0)
    assert (greedy["eval/easy/greedy_accuracy"], final["eval/hard/accuracy"]) == (0.75, 0.25)
    assert "eval/easy/accuracy" not in greedy


def test_the_summary_has_a_row_per_source(tmp_path):
    rows = [{"step": s, "source/easy/reward": 0.1 * s, "source/easy/accuracy": 0.0} for s in range(1, 8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = by_source(evals(), tmp_path)
    assert table["easy"] == {
        "num_prompts": 4,
        "sampled_start": 0.5,
        "greedy_start": 0.75,
        "sampled_end": 1.0,
        "train_reward": pytest.approx(0.5),
        "train_accuracy": 0.0,
    }
    assert table["hard"]["train_reward"] is None and table["hard"]["sampled_end"] == 0.25
    assert by_source([m.EvalResult(0, 0.3, 0.3, 7, "start")], tmp_path) == {}
