"""`python -m bench.staleness.ablate` end to end with two tiny runs (naive and decoupled PPO at exact delay
1, one seed, 3 steps on countdown): both launch.local runs finish, the paired table, JSON and
figure are whole, and `table` rebuilds the same cells from the run directories alone.

No accuracy or speed assertion: 3 steps teach nothing; the numbers live in the ablation itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

REPO = Path(__file__).resolve().parents[3]


def test_two_run_ablation_writes_paired_table_json_and_plot(tmp_path):
    out, runs = tmp_path / "out", tmp_path / "runs"
    common = ["--out", str(out), "--run-root", str(runs)]
    cmd = [
        sys.executable, "-m", "bench.staleness.ablate", "run", "--arms", "naive,decoupled", "--delays", "1",
        "--seeds", "1", "--steps", "3", "--lr", "1e-3", *common,
        "data.num_eval_prompts=4", "run.eval_samples=1", "run.eval_pass_k=1", "algo.batch_size=2",
        "algo.group_size=2",
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((out / "ablation.json").read_text())
    assert [(r["arm"], r["delay"], r["seed"]) for r in data["runs"]] == [("naive", 1, 1), ("decoupled", 1, 1)]
    for r in data["runs"]:
        assert "error" not in r, r.get("error")
        assert r["max_staleness_seen"] == 1 and r["steps_at_delay"] == 2.0  # steps 2 and 3: 1 version old
        assert 0.0 <= r["sampled_end"] <= 1.0 and 0.0 <= r["preclip"] <= 1.0 and r["reward_auc"] is not None
    cell = data["cells"]["0.001/4/1"]
    assert cell["paired"]["decoupled-naive"]["sampled_end"]["seeds"] == [1]
    assert (out / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[2/2] decoupled-lr0.001-mb4-d1-s1-n3" in result.stdout
    table = subprocess.run(
        [sys.executable, "-m", "bench.staleness.ablate", "table", *common],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert table.returncode == 0, table.stderr[-2000:]
    assert json.loads((out / "ablation.json").read_text())["cells"] == data["cells"]
