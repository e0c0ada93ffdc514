"""`python -m bench --quick` end to end: every section runs and reports its metrics.

No timing assertions: speed claims live in the bench output. This checks that the bench can run
at all (real SGLang server, launch.local, reward workers, Megatron) and that results.json is whole.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import SECTIONS

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

REPO = Path(__file__).resolve().parents[3]

EXPECTED = {
    "e2e": [
        "e2e/async_over_sync",
        "e2e/ideal_overlap_bound",
        "e2e/colocated_tokens_per_s",
        "e2e/sync_gen_wait_s",  # the per-step breakdown
        "e2e/load_mean",
        "e2e/colocated_prefill_tokens_per_s",
    ],
    "pause": [
        "pause/abort_gen_tokens_per_s",
        "pause/in_place_gen_tokens_per_s",
        "pause/drain_gen_tokens_per_s",
    ],
    "reward_overhead": ["reward_overhead/on_over_off"],
    "weight_sync": ["weight_sync/tiny_gb_per_s", "weight_sync/gloo_gb_per_s", "weight_sync/memcpy_gb_per_s"],
    "weight_delta": [
        "weight_delta/sglang_full_update_s",
        "weight_delta/sglang_delta_update_s",
        "weight_delta/vllm_delta_server_apply_s",
        "weight_delta/builtin_changed_share_mean",
        "weight_delta/builtin_full_over_delta_bytes",
    ],
    "packing": [
        "packing/task_nonpad_share_packed",
        "packing/paper_imbalance_balanced",
        "packing/paper_imbalance_naive",
    ],
    "controller": ["controller/completed_requests_per_s", "transport/messages_per_s", "transport/mb_per_s"],
    "reward": ["reward/math_per_s"],
    "reward_model": ["reward_model/answers_per_s", "reward_model/batching_gain", "reward_model/agreement"],
    "trainer": ["trainer/torch_tokens_per_s"],
    "trainer_memory": [
        "trainer_memory/torch_after_1k_peak_gib",
        "trainer_memory/torch_before_1k_peak_gib",
        "trainer_memory/megatron_after_1k_peak_gib",
        "trainer_memory/megatron_after_1k_predicted_gib",
    ],
    "engine": ["engine/vllm_over_sglang_gen", "engine/vllm_update_s", "engine/sglang_update_s"],
}


def test_quick_bench_reports_every_section(tmp_path):
    out = tmp_path / "results.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert out.exists(), result.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["errors"] == {}, "\n".join(results["errors"].values())[-4000:]
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(results["sections"]) == {name for name, _, _ in SECTIONS}
    for section, keys in EXPECTED.items():
        metrics = results["sections"][section]
        for key in keys:
            assert key in metrics and metrics[key] > 0, (section, key, metrics)
    assert "| section | measure | value |" in result.stdout
    assert "### trainer_memory: one step" in result.stdout
    assert "### e2e: per step" in result.stdout and "### e2e: ratios over rounds" in result.stdout
    assert (out.with_suffix(".md")).exists()
