"""logging.wandb=true without an API key: an offline W&B run in RUN_DIR/wandb (syncable later) with
the same flat metric keys as metrics.jsonl and the resolved config attached."""

from __future__ import annotations

import json

import pytest

from areal_jobs.config import JobConfig
from areal_jobs.metrics import build_sink
from areal_jobs.trainer.session import wandb_settings


def test_offline_run_has_the_flat_keys_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))  # wandb's own settings stay in the test's dir
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_SERVICE", "")  # wandb.init sets it for the process: restored after
    monkeypatch.delenv("WANDB_SERVICE")
    cfg = JobConfig()
    cfg.logging.wandb = True
    cfg.logging.wandb_group = "sweep-1"
    settings = wandb_settings(cfg)
    assert settings["name"] == "tiny-arith" and settings["mode"] == "auto"
    assert settings["config"]["data"]["chat_template"] == "auto"
    sink = build_sink(tmp_path, tensorboard=False, wandb=settings)
    rows = [{"reward/mean": 0.5, "gen/truncation_rate": 0.25}, {"eval/accuracy": 0.125}]
    for step, row in enumerate(rows, start=1):
        sink.log(step, row)
    sink.close()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "mode auto without a key must run offline"
    (record,) = runs[0].glob("*.wandb")
    content = record.read_bytes()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    keys = {k for row in logged for k in row} - {"step", "time"}
    assert keys == {"reward/mean", "gen/truncation_rate", "eval/accuracy"}
    for key in [*keys, "sweep-1", "chat_template", "max_staleness"]:
        assert key.encode() in content, f"{key} not in the W&B run file"
    assert (tmp_path / "wandb_id").read_text().strip() in runs[0].name
