"""The whole job on this machine through `python -m launch.local` (what `make run` runs):
real SGLang server, controller, reward workers and torch trainer as separate processes.

The staleness bound is checked on what was actually trained: every ledger row records the oldest
policy version in its batch, and the trainer's version when it trained on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_jobs.report import FINAL_KEYS

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]


def run_local(tmp_path: Path, model_dir: Path, name: str, *overrides: str) -> Path:
    cmd = [
        sys.executable, "-m", "launch.local",
        f"run.name={name}", f"run.root={tmp_path}", f"model.path={model_dir}",
        "algo.batch_size=2", "algo.group_size=2", "rollout.max_new_tokens=32",
        "data.num_eval_prompts=4", "run.eval_every_steps=2", "run.tensorboard=false",
        *overrides,
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    run_dir = tmp_path / name
    if result.returncode != 0:
        logs = "\n".join(f"== {p.name}\n{p.read_text()[-2500:]}" for p in sorted((run_dir / "logs").glob("*.log")))
        pytest.fail(f"launch.local failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}\n{logs}")
    assert "final: accuracy_start=" in result.stdout
    return run_dir


def ledger(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]


def test_async_run_respects_eta_and_interrupts(tmp_path, tiny_model_dir):
    run_dir = run_local(tmp_path, tiny_model_dir, "eta4", "algo.max_staleness=4", "trainer.total_steps=6")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(FINAL_KEYS) <= set(summary)
    assert summary["steps"] == 6 and summary["accuracy_start"] is not None and summary["accuracy_end"] is not None
    rows = ledger(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["trained_at_version"] - r["oldest_version"] <= 4 for r in rows)
    assert all(r["max_staleness"] <= 4 for r in rows)
    assert summary["max_staleness_seen"] == max(r["max_staleness"] for r in rows) <= 4
    # asynchrony is real: later batches hold tokens from older policies, and updates interrupted requests
    assert summary["max_staleness_seen"] >= 1
    assert summary["interrupted_requests"] > 0
    samples = [s for r in rows for s in r["samples"]]
    assert len(samples) == len(set(samples)) == 6 * 2 * 2
    for artefact in ("metrics.jsonl", "reward_accuracy.png", "final_hf/model.safetensors", "config.yaml"):
        assert (run_dir / artefact).exists(), artefact
    for log in ("server-0.log", "controller.log", "trainer.log"):
        assert (run_dir / "logs" / log).exists(), log


def test_eta_zero_trains_only_on_the_current_version(tmp_path, tiny_model_dir):
    run_dir = run_local(tmp_path, tiny_model_dir, "eta0", "algo.max_staleness=0", "trainer.total_steps=4")
    rows = ledger(run_dir)
    assert len(rows) == 4
    for r in rows:
        assert r["oldest_version"] == r["trained_at_version"] == r["step"] - 1
        assert r["max_staleness"] == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["max_staleness_seen"] == 0
