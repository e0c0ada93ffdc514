"""What the trainer does with the controller's evaluations: the eval/* metric rows, keyed to the
policy version measured, and the pass@k / greedy keys of summary.json and the final line."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from areal_jobs.config import JobConfig
from areal_jobs.report import final_line
from areal_jobs.trainer.loop import TrainLoop
from areal_jobs.trainer.session import summary
from areal_jobs.transport import messages as m


class Sink:
    def __init__(self):
        self.rows = []

    def log(self, step, row):
        self.rows.append((step, row))


def evals():
    return [
        m.EvalResult(
            0,
            0.25,
            0.25,
            8,
            "start",
            pass_at_k=0.5,
            k=4,
            samples_per_problem=4,
            mean_length_tokens=30.0,
            truncation_rate=0.125,
        ),  # fmt: skip
        m.EvalResult(0, 0.5, 0.5, 8, "start_greedy"),
        m.EvalResult(20, 0.75, 0.75, 8, "final", pass_at_k=0.875, k=4, samples_per_problem=4),
        m.EvalResult(20, 0.625, 0.625, 8, "final_greedy"),
    ]


def test_each_evaluation_is_logged_with_pass_at_k_greedy_and_its_version():
    pending = evals()[:2]
    inbox = SimpleNamespace(take_evals=lambda: [pending.pop(0) for _ in range(len(pending))])
    loop = SimpleNamespace(inbox=inbox, sink=Sink(), step=3)
    TrainLoop.log_evals(loop)
    (s1, sampled), (s2, greedy) = loop.sink.rows
    assert s1 == s2 == 3 and pending == []
    assert sampled["eval/pass@1"] == sampled["eval/accuracy"] == 0.25
    assert (sampled["eval/pass@k"], sampled["eval/k"], sampled["eval/version"]) == (0.5, 4.0, 0.0)
    assert (sampled["eval/mean_length_tokens"], sampled["eval/truncation_rate"]) == (30.0, 0.125)
    assert (
        greedy["eval/greedy"] == greedy["eval/greedy_accuracy"] == 0.5
        and greedy["eval/greedy_version"] == 0.0
    )
    assert "eval/pass@1" not in greedy


def test_summary_and_final_line_carry_pass_at_k_start_and_end(tmp_path):
    loop = SimpleNamespace(step=20, max_staleness_seen=2, trained_tokens=100, expired_groups=0)
    inbox = SimpleNamespace(all_evals=evals())
    stopped = m.Stopped(num_groups_pushed=5, metrics={"rollout/interrupted_requests": 7.0})
    got = summary(JobConfig(), tmp_path, loop, inbox, stopped, False, time.time())
    assert (got["accuracy_start"], got["accuracy_end"]) == (0.25, 0.75)
    assert (got["pass_at_k_start"], got["pass_at_k_end"], got["pass_at_k_k"]) == (0.5, 0.875, 4)
    assert (got["greedy_accuracy_start"], got["greedy_accuracy_end"]) == (0.5, 0.625)
    line = final_line(got)
    assert "pass_at_k_start=0.500 pass_at_k_end=0.875" in line and "accuracy_end=0.750" in line


def test_a_tool_workflow_adds_its_tool_calls_to_the_summary_and_final_line(tmp_path):
    rows = [{"step": i, "episode/tool_calls": float(i)} for i in range(1, 13)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    loop = SimpleNamespace(step=12, max_staleness_seen=2, trained_tokens=100, expired_groups=0)
    inbox = SimpleNamespace(all_evals=evals())
    stopped = m.Stopped(num_groups_pushed=5, metrics={})
    cfg = JobConfig()
    assert "tool_calls_start" not in summary(cfg, tmp_path, loop, inbox, stopped, False, time.time())
    cfg.rollout.workflow.name = "tool_arith"
    got = summary(cfg, tmp_path, loop, inbox, stopped, False, time.time())
    assert (got["tool_calls_start"], got["tool_calls_end"]) == (3.0, 10.0)  # steps 1-5 and 8-12
    assert final_line(got).endswith("tool_calls_start=3.000 tool_calls_end=10.000")
