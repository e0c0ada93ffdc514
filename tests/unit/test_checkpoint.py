"""Checkpoint layout: only committed checkpoints count, old ones are pruned, logs are truncated."""

import json

import pytest

from areal_jobs import checkpoint as ckpt


def make(run_dir, step, commit=True):
    folder = ckpt.step_dir(run_dir, step)
    (folder / "trainer").mkdir(parents=True)
    if commit:
        ckpt.commit(run_dir, folder, {"step": step}, keep_last=2)
    return folder


def test_latest_is_the_last_committed_one_and_old_ones_are_pruned(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path) is None
    for step in (2, 4, 6):
        make(tmp_path, step)
    make(tmp_path, 8, commit=False)  # a crash while saving: not counted
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest.name == "step_000006" and ckpt.read_meta(latest) == {"step": 6}
    assert not ckpt.step_dir(tmp_path, 2).exists() and ckpt.step_dir(tmp_path, 4).exists()


def test_a_pointer_to_an_incomplete_checkpoint_is_an_error(tmp_path):
    make(tmp_path, 2)
    (ckpt.checkpoints_dir(tmp_path) / "latest").write_text("step_000009")
    with pytest.raises(FileNotFoundError, match="incomplete"):
        ckpt.latest_checkpoint(tmp_path)


def test_truncate_jsonl_keeps_rows_up_to_the_step(tmp_path):
    path = tmp_path / "ledger.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    assert ckpt.truncate_jsonl(path, 2) == 2
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    assert ckpt.truncate_jsonl(tmp_path / "missing.jsonl", 3) == 0
