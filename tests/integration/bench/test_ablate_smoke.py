"""`python -m bench.ablate` end to end with two tiny runs (η = 0 and 4, decoupled PPO, one seed,
2 steps): both launch.local runs finish and the JSON, markdown table and PNG are whole.

No accuracy or speed assertion: 2 steps teach nothing; the numbers live in the ablation itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

REPO = Path(__file__).resolve().parents[3]


def test_two_run_ablation_writes_json_table_and_plot(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "bench.ablate", "--etas", "0,4", "--objectives", "decoupled", "--seeds", "1",
        "--steps", "2", "--out", str(out), "--run-root", str(tmp_path / "runs"),
        "data.num_eval_prompts=8", "run.eval_samples=1", "run.eval_pass_k=1", "algo.batch_size=4",
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((out / "ablation.json").read_text())
    assert data["settings"]["etas"] == [0, 4] and data["settings"]["steps"] == 2
    runs = data["runs"]
    assert [(r["eta"], r["objective"], r["seed"]) for r in runs] == [(0, "decoupled", 1), (4, "decoupled", 1)]
    for r in runs:
        assert "error" not in r, r.get("error")
        assert r["steps"] == 2 and r["tokens_per_s"] > 0
        assert 0.0 <= r["greedy_end"] <= 1.0 and 0.0 <= r["sampled_end"] <= 1.0
        versions = [p[0] for p in r["curve"]]
        assert versions[0] == 0 and versions[-1] == 2  # the start and end evaluations, by version
    assert set(data["table"]) == {"0", "4"} and set(data["table"]["4"]) == {"decoupled"}
    table = (out / "ablation.md").read_text()
    assert table.startswith("| η | decoupled greedy | decoupled sampled | decoupled tokens/s |")
    assert "naive" not in table.splitlines()[0]
    assert (out / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[2/2] η=4 decoupled seed=1" in result.stdout
