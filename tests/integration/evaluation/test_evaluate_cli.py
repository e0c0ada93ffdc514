"""`python -m launch.evaluate` end to end on the committed built-in models, for each built-in set
(`--data builtin`: the arithmetic task's warm start; `--data countdown`: the countdown warm start,
the default checkpoint for that set): it starts a real SGLang CPU server (once per set), samples
n answers and one greedy answer per held-out problem, and writes eval.json and eval.png. Checked:
the file is whole, the numbers agree with each other and with the per-problem rows, and every
stored answer earns the reward the JSON says it earned when scored again by the task's reward
function."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_jobs.reward.registry import resolve
from areal_jobs.rollout.eval_metrics import pass_at_k

pytestmark = [pytest.mark.sglang]

REPO = Path(__file__).resolve().parents[3]
N, LIMIT, MAX_NEW = 4, 24, 160


SETS = {"builtin": "arith", "countdown": "countdown"}  # --data -> its reward task


@pytest.fixture(scope="module", params=list(SETS))
def evaluated(request, tmp_path_factory) -> tuple[dict, Path, str]:
    out = tmp_path_factory.mktemp("eval")
    cmd = [
        sys.executable, "-m", "launch.evaluate", "--data", request.param, "--limit", str(LIMIT),
        "-n", str(N), "-k", "1", "-k", "2", "-k", str(N), "--max-new-tokens", str(MAX_NEW),
        "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"launch.evaluate failed:\n{proc.stderr[-4000:]}"
    return json.loads((out / "eval.json").read_text()), out, proc.stdout


def test_json_png_and_printed_line(evaluated):
    report, out, stdout = evaluated
    assert (out / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["num_problems"] == LIMIT == len(report["problems"]) and report["samples_per_problem"] == N
    assert report["format"] in SETS and report["max_new_tokens"] == MAX_NEW
    line = [x for x in stdout.splitlines() if x.startswith("eval: ")]
    assert line and f"pass@1={report['pass@1']:.3f}" in line[0] and f"pass@{N}=" in line[0]
    assert f"greedy={report['greedy_accuracy']:.3f}" in line[0]


def test_numbers_agree_with_each_other_and_with_the_rows(evaluated):
    report, _, _ = evaluated
    rows = report["problems"]
    curve = [report["pass_at_k_curve"][str(k)] for k in range(1, N + 1)]
    assert report["pass@k"]["1"] == pytest.approx(report["pass@1"])
    assert all(a <= b + 1e-12 for a, b in zip(curve, curve[1:])), curve  # pass@k grows with k
    assert report["pass@1"] == pytest.approx(sum(r["num_correct"] / N for r in rows) / LIMIT)
    assert report["pass@k"][str(N)] == pytest.approx(sum(r["num_correct"] > 0 for r in rows) / LIMIT)
    assert report["pass@k"]["2"] == pytest.approx(
        sum(pass_at_k(N, r["num_correct"], 2) for r in rows) / LIMIT
    )
    lengths = [x for r in rows for x in r["lengths"]]
    assert report["mean_length_tokens"] == pytest.approx(sum(lengths) / len(lengths)) and min(lengths) >= 1
    truncated = [t for r in rows for t in r["truncated"]]
    assert report["truncation_rate"] == pytest.approx(sum(truncated) / len(truncated))
    assert all(x == MAX_NEW for r in rows for x, t in zip(r["lengths"], r["truncated"]) if t)
    assert all(x <= MAX_NEW for x in lengths)
    assert report["greedy_accuracy"] == pytest.approx(sum(r["greedy_reward"] >= 1.0 for r in rows) / LIMIT)
    # the warm start answers some problems right: not a broken pipeline scoring everything 0
    assert report["pass@k"][str(N)] > 0 and report["greedy_accuracy"] > 0


def test_stored_answers_earn_the_reported_rewards(evaluated):
    report, _, _ = evaluated
    reward = resolve(SETS[report["format"]])
    for r in report["problems"]:
        assert reward(r["first_answer"], r["reference"]).reward == r["rewards"][0]
        assert reward(r["greedy_answer"], r["reference"]).reward == r["greedy_reward"]
