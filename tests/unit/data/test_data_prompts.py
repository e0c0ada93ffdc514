"""Prompt streams are deterministic by position; bad dataset rows are skipped with file and line."""

import json

import pytest

from areal_jobs.config import DataConfig, Dataset
from areal_jobs.data.chat import PromptFormat
from areal_jobs.data.prompts import PromptStream, eval_prompts, load_rows


def encode(text):
    return [ord(c) % 250 for c in text]


def raw(dataset):
    return PromptFormat.load(
        DataConfig(dataset=dataset, train_path="x", chat_template="none"), "/nonexistent"
    )


def test_stream_is_a_function_of_position():
    a, b = PromptStream(DataConfig(seed=3), encode), PromptStream(DataConfig(seed=3), encode)
    first = [a.next() for _ in range(5)]
    b.position = 2
    assert [b.next() for _ in range(3)] == first[2:]
    assert [p.data_index for p in first] == list(range(5))
    held_out = eval_prompts(DataConfig(seed=3, num_eval_prompts=5), encode)
    assert not {tuple(p.input_ids) for p in held_out} & {tuple(p.input_ids) for p in first}


def test_bad_rows_are_skipped_and_reported_with_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [
        json.dumps({"question": "1+1?", "answer": "2\n#### 2"}),
        "{not json",
        json.dumps({"question": "no final answer", "answer": "7"}),
        json.dumps({"answer": "#### 3"}),
        json.dumps({"question": "x" * 5000, "answer": "#### 1"}),
        "",
        json.dumps({"question": "2+2?", "answer": "#### 4"}),
    ]
    path.write_text("\n".join(rows) + "\n")
    kept, report = load_rows(raw(Dataset.gsm8k), str(path), encode, max_prompt_tokens=512)
    assert [r.reference for r in kept] == ["2", "4"]
    assert report.num_rows == 6 and len(report.skipped) == 4
    assert [s.split(":")[1] for s in report.skipped] == ["2", "3", "4", "5"]
    assert "data.max_prompt_tokens" in report.skipped[-1]


def test_file_epochs_are_reshuffled_deterministically(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(6))
    )
    cfg = DataConfig(dataset=Dataset.gsm8k, train_path=str(path))
    rows, _ = load_rows(raw(cfg.dataset), str(path), encode, 512)
    stream = PromptStream(cfg, encode, rows)
    epoch0 = sorted(stream.at(i).reference for i in range(6))
    assert epoch0 == [str(i) for i in range(6)]
    assert [stream.at(i).reference for i in range(6, 12)] == [
        PromptStream(cfg, encode, rows).at(i).reference for i in range(6, 12)
    ]


def test_no_usable_rows_is_an_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("{}\n")
    with pytest.raises(ValueError, match="no usable rows"):
        load_rows(raw(Dataset.gsm8k), str(path), encode, 512)
