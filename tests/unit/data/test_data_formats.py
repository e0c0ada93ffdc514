"""Rows in the field's formats (Parquet, JSON, JSONL, save_to_disk), nested keys, chat-message
prompts, verl's and AReaL's shapes with no mapping, and every bad input with the message the user
sees. The files are written here with pyarrow and `datasets`, as verl and AReaL users write them."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_jobs.config import DataConfig, DataFormat, Dataset
from areal_jobs.data.chat import PromptFormat
from areal_jobs.data.formats import detect_format, get_field
from areal_jobs.data.prompts import load_prompts, load_rows

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def encode(text):
    return [ord(c) % 250 for c in text]


def verl_row(i, question="What is 2+3?", answer="5"):
    """verl's exact schema (examples/data_preprocess/gsm8k.py)."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{question} #{i}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": i, "answer": "long solution", "question": question},
    }


def file_format(tmp_path, chat_template="none", **kw):
    cfg = DataConfig(dataset=Dataset.file, train_path="x", chat_template=chat_template, **kw)
    if chat_template not in ("none", "auto"):
        path = tmp_path / "t.jinja"
        path.write_text(chat_template)
        cfg.chat_template = str(path)
    return PromptFormat.load(cfg, "/nonexistent")


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_parquet_in_verls_schema_needs_no_mapping(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", [verl_row(i) for i in range(3)])
    rows, report = load_rows(file_format(tmp_path, CHATML), path, encode, 512)
    assert report.skipped == [] and len(rows) == 3
    row = rows[1]
    # the messages go through the chat template as they are (no instruction appended)
    assert row.text == "<|im_start|>user\nWhat is 2+3? #1<|im_end|>\n<|im_start|>assistant\n"
    assert row.reference == "5" and row.data_source == "openai/gsm8k" and row.reward_task == "gsm8k"
    extra = json.loads(row.extra_info)
    # verl's extra_info merged over the row's other fields; the prompt itself does not travel
    assert extra == {
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "5"},
        "split": "train",
        "index": 1,
        "answer": "long solution",
        "question": "What is 2+3?",
    }


@pytest.mark.parametrize("kind", ["json", "jsonl", "json_lines_named_json", "hf_disk", "parquet"])
def test_every_format_gives_the_same_rows(tmp_path, kind):
    rows = [verl_row(i, answer=str(i)) for i in range(4)]
    if kind == "json":
        path = tmp_path / "rows.json"
        path.write_text(json.dumps(rows))
    elif kind in ("jsonl", "json_lines_named_json"):
        path = tmp_path / ("rows.jsonl" if kind == "jsonl" else "rows.json")
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "hf_disk":
        import datasets

        path = tmp_path / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    else:
        path = tmp_path / "rows.parquet"
        write_parquet(path, rows)
    expected = {"json": DataFormat.json, "hf_disk": DataFormat.hf_disk, "parquet": DataFormat.parquet}
    assert detect_format(str(path)) is expected.get(kind, DataFormat.jsonl)
    got, report = load_rows(file_format(tmp_path), str(path), encode, 512)
    assert report.skipped == []
    assert [(r.text, r.reference, r.data_source) for r in got] == [
        (f"What is 2+3? #{i}", str(i), "openai/gsm8k") for i in range(4)
    ]


def test_the_format_override_reads_a_file_the_name_does_not_tell(tmp_path):
    path = tmp_path / "rows.data"
    write_parquet(path, [verl_row(0)])
    assert detect_format(str(path)) is DataFormat.parquet  # Parquet's magic bytes
    path2 = tmp_path / "rows.txt"
    path2.write_text(json.dumps([verl_row(0)]))
    with pytest.raises(ValueError, match="JSON lines need data.format=jsonl"):
        rows = [verl_row(0)]
        (tmp_path / "lines.txt").write_text("".join(json.dumps(r) + "\n" for r in rows * 2))
        load_rows(file_format(tmp_path), str(tmp_path / "lines.txt"), encode, 512, DataFormat.json)
    got, _ = load_rows(file_format(tmp_path), str(path2), encode, 512, DataFormat.json)
    assert got[0].reference == "5"


def test_a_datasetdict_directory_asks_for_a_split(tmp_path):
    import datasets

    path = tmp_path / "dd"
    split = datasets.Dataset.from_list([verl_row(0)])
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(path))
    with pytest.raises(ValueError) as err:
        load_rows(file_format(tmp_path), str(path), encode, 512)
    assert str(err.value) == (
        f"data.train_path={path} is a DatasetDict with splits ['test', 'train']: point at one split's "
        f"directory, e.g. data.train_path={path / 'test'}"
    )
    got, _ = load_rows(file_format(tmp_path), str(path / "train"), encode, 512)
    assert len(got) == 1


@pytest.mark.parametrize(
    ("row", "prompt", "reference"),
    [
        ({"question": "Q?", "answer": "work\n#### 7"}, "Q?", "7"),  # AReaL's GSM8K loader
        ({"messages": [{"role": "user", "content": "M?"}], "answer": "8"}, "M?", "8"),
        ({"prompt": "P?", "solution": "\\boxed{9}"}, "P?", "\\boxed{9}"),  # AReaL RL sets
        ({"problem": "R?", "ground_truth": "10"}, "R?", "10"),
    ],
)
def test_areals_shapes_need_no_mapping(tmp_path, row, prompt, reference):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (got,), _ = load_rows(file_format(tmp_path), str(path), encode, 512)
    assert (got.text, got.reference, got.reward_task) == (prompt, reference, "math")


def test_nested_keys_reach_into_objects(tmp_path):
    row = {"input": {"query": {"text": "deep?"}}, "labels": {"gold": 3}}
    assert get_field(row, "input.query.text") == "deep?"
    assert get_field({"a.b": 1, "a": {"b": 2}}, "a.b") == 1  # a column named with a dot wins
    fmt = file_format(tmp_path, prompt_key="input.query.text", answer_key="labels.gold")
    path = tmp_path / "n.json"
    path.write_text(json.dumps([row]))
    (got,), _ = load_rows(fmt, str(path), encode, 512)
    assert (got.text, got.reference) == ("deep?", "3")


def test_the_system_prompt_joins_messages_without_one(tmp_path):
    fmt = file_format(tmp_path, CHATML, system_prompt="Be brief.")
    with_system = [{"role": "system", "content": "Own."}, {"role": "user", "content": "Q"}]
    assert fmt.render_messages(with_system).startswith("<|im_start|>system\nOwn.<|im_end|>")
    assert fmt.render_messages([{"role": "user", "content": "Q"}]).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>"
    )
    raw = file_format(tmp_path)
    assert raw.render_messages(with_system) == "Own.\n\nQ"


def test_each_bad_row_is_skipped_with_where_and_why(tmp_path):
    good = verl_row(0)
    rows = [
        good,
        {**good, "reward_model": {"style": "rule"}},  # the nested answer is missing
        {**good, "prompt": []},
        {**good, "prompt": [{"role": "user", "content": "   "}]},
        {**good, "prompt": [{"role": "user", "content": "x" * 600}]},
        {**good, "prompt": [{"role": "user", "text": "no content"}]},
    ]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    fmt = file_format(tmp_path, answer_key="reward_model.ground_truth")
    got, report = load_rows(fmt, path, encode, 512)
    assert len(got) == 1 and report.num_rows == 6
    assert report.skipped == [
        f"{path}:row 2: KeyError: \"none of the answer fields ['reward_model.ground_truth'] is present\"",
        f"{path}:row 3: ValueError: empty prompt (no messages)",
        f"{path}:row 4: ValueError: empty prompt (messages without content)",
        f"{path}:row 5: prompt longer than data.max_prompt_tokens=512",
        f"{path}:row 6: TypeError: chat messages must be {{role, content}} objects with text content",
    ]


def test_missing_fields_and_empty_text_prompts_are_named(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(
        json.dumps({"other": 1, "answer": "1"}) + "\n" + json.dumps({"prompt": "", "answer": "2"}) + "\n"
    )
    with pytest.raises(ValueError) as err:
        load_rows(file_format(tmp_path), str(path), encode, 512)
    assert str(err.value) == (
        f'no usable rows in {path} (first reasons: {path}:1: KeyError: "none of the prompt fields '
        f"['prompt', 'messages', 'question', 'problem'] is present\"; {path}:2: ValueError: empty prompt): "
        "fix the file or point data.train_path elsewhere"
    )
    fmt = file_format(tmp_path, prompt_key="input.text")
    with pytest.raises(ValueError, match=r"field 'input.text' is missing \(no 'input'\)"):
        load_rows(fmt, str(path), encode, 512)


def test_a_missing_file_and_an_unreadable_json_are_refused_at_start(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_rows(file_format(tmp_path), str(tmp_path / "nope.parquet"), encode, 512)
    assert str(err.value) == f"data.train_path={tmp_path / 'nope.parquet'}: no such file or directory"
    path = tmp_path / "obj.json"
    path.write_text('[{"prompt": "a", "answer": "1"}')
    with pytest.raises(ValueError, match="is not one JSON document"):
        load_rows(file_format(tmp_path), str(path), encode, 512)


def test_a_train_path_with_the_default_dataset_reads_the_file(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", [verl_row(i, answer=str(i)) for i in range(6)])
    cfg = DataConfig(train_path=path, num_eval_prompts=2, chat_template="none")
    assert cfg.dataset is Dataset.file
    prompts = load_prompts(cfg, "/nonexistent", encode)
    first = prompts.stream.at(0)
    assert first.reward_task == "gsm8k" and first.data_source == first.source == "openai/gsm8k"
    assert json.loads(first.extra_info)["split"] == "train"
    assert [p.reference for p in prompts.held_out] == ["4", "5"]
    # reward.function scores every prompt of a single dataset (the reward registry resolves it)
    scored = load_prompts(cfg, "/nonexistent", encode, "my_rewards.py:compute_score")
    assert {scored.stream.at(i).reward_task for i in range(4)} == {"my_rewards.py:compute_score"}
    with pytest.raises(ValueError, match="drop data.train_path or set data.dataset=file"):
        DataConfig(dataset=Dataset.countdown, train_path=path)


def test_the_six_jsonl_shapes_keep_their_rewards(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "so\n#### 2"}) + "\n")
    fmt = PromptFormat.load(
        DataConfig(dataset=Dataset.gsm8k, train_path=str(path), chat_template="none"), "/x"
    )
    (row,), _ = load_rows(fmt, str(path), encode, 512)
    assert (row.reference, row.data_source, row.extra_info, row.reward_task) == ("2", "", "{}", "")
