"""`python -m bench.staleness.ablation_probe` on the countdown warm start, small: at delay 0 the naive and
decoupled gradients are the same (no token is off-policy, cosine 1); after on-policy steps the
stale batch's weights have moved (|log w| > 0) and probe.json holds a row per delay.

No assertion on how far the cosines fall: that is the probe's measurement (bench/README.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def test_probe_cosine_is_one_on_policy_and_the_weights_move_after_steps(tmp_path):
    cmd = [
        sys.executable, "-m", "bench.staleness.ablation_probe", "--lrs", "1e-3", "--delays", "0,2", "--batch-size", "4",
        "--group-size", "4", "--max-new-tokens", "192", "--minibatches", "2", "--out", str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "probe.json").read_text())["rows"]
    assert [r["delay"] for r in rows] == [0, 2]
    on_policy, stale = rows
    assert on_policy["grad_norm_naive"] > 0, "every group's rewards were equal: no gradient to compare"
    assert on_policy["cos_naive_decoupled_cap5"] == pytest.approx(1.0, abs=1e-9)
    assert on_policy["preclip_fraction"] == 0.0 and on_policy["abs_log_w_p99"] < 1e-3  # a histogram bin edge
    assert stale["abs_log_w_p99"] > 0.0, "two RL steps at lr 1e-3 left the policy where it was"
    for r in rows:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert -1.0 <= r["cos_naive_decoupled_nocap"] <= 1.0 + 1e-9
    assert "| 0.001 | 2 |" in result.stdout  # the printed table
