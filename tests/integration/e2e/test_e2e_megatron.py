"""trainer=megatron with two trainer processes through `python -m launch.local` on CPU: real
SGLang server, controller, reward workers, and Megatron-Core ranks under gloo.

TP=2: rank 1 joins every collective (train step, the TP gathers of each weight export, save_hf)
on rank 0's command. PP=2: each pipeline stage has its own sender, so every update is two
broadcast groups; a SIGUSR1 (to both ranks, as srun forwards it) checkpoints collectively, and
the same command resumes on both ranks. The final greedy evaluation ran at the final version,
so the servers received every update.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from .test_e2e_local import ledger, run_local, start_local, wait_for_steps

pytestmark = [pytest.mark.megatron, pytest.mark.sglang, pytest.mark.slow]

MEGATRON = ("trainer=megatron",)


def metric_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_finished(run_dir, steps: int, senders: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    assert summary["accuracy_start"] is not None and summary["accuracy_end"] is not None
    rows = ledger(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    samples = [s for r in rows for s in r["samples"]]
    assert len(samples) == len(set(samples)) == steps * 2 * 2
    metrics = metric_rows(run_dir)
    updates = [r for r in metrics if "weight_sync/num_senders" in r]
    assert len(updates) >= steps
    assert all(r["weight_sync/num_senders"] == senders and r["weight_sync/bytes"] > 0 for r in updates)
    # evaluated by the servers at the last version: every update reached them
    final = [r for r in metrics if "eval/greedy_version" in r]
    assert final and final[-1]["eval/greedy_version"] == steps
    index = json.loads((run_dir / "final_hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == senders  # one shard per pipeline stage
    assert (run_dir / "logs" / "trainer-1.log").exists()
    pids = json.loads((run_dir / "pids.json").read_text())
    assert {"trainer", "trainer-1"} <= set(pids)
    return summary


def test_tensor_parallel_2_ranks_train_and_publish(tmp_path, tiny_model_dir):
    run_dir = run_local(
        tmp_path, tiny_model_dir, "tp2", *MEGATRON, "trainer.tp_size=2", "trainer.total_steps=3"
    )
    summary = check_finished(run_dir, steps=3, senders=1)
    assert summary["resumed"] is False


def test_pipeline_2_stages_preempted_on_every_rank_then_resumed(tmp_path, tiny_model_dir):
    args = (*MEGATRON, "trainer.pp_size=2", "trainer.total_steps=8", "checkpoint.every_steps=0",
            "weight_sync.bucket_bytes=1000000")  # fmt: skip
    proc = start_local(tmp_path, tiny_model_dir, "pp2", *args)
    run_dir = tmp_path / "pp2"
    wait_for_steps(run_dir, 1, proc)
    pids = json.loads((run_dir / "pids.json").read_text())
    for name in ("trainer", "trainer-1"):  # srun forwards the signal to every task
        os.kill(pids[name], signal.SIGUSR1)
    assert proc.wait(timeout=600) == 3, proc.stdout.read()[-3000:]
    assert not (run_dir / "summary.json").exists()
    assert (run_dir / "checkpoints" / "latest").exists()
    assert "rank 0 decides" in (run_dir / "logs" / "trainer-1.log").read_text()

    run_dir = run_local(tmp_path, tiny_model_dir, "pp2", *args)
    assert "resumed from checkpoint at step" in (run_dir / "logs" / "trainer.log").read_text()
    summary = check_finished(run_dir, steps=8, senders=2)  # steps: room for the signal to land before the end
    assert summary["resumed"] is True
