"""Prompts as configuration: chat template auto/none/file, system prompt, instruction, row layouts."""

import json

import pytest

from areal_jobs.config import DataConfig, Dataset
from areal_jobs.data.chat import STEP_BY_STEP_BOXED, PromptFormat
from areal_jobs.data.prompts import load_prompts, load_rows

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GSM8K_ROW = {"question": "What is 2+3?", "answer": "2+3=5\n#### 5"}


def encode(text):
    return [ord(c) % 250 for c in text]


@pytest.fixture
def chat_model(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"})
    )
    return tmp_path


def fmt(model_dir, **data):
    data.setdefault("dataset", Dataset.gsm8k)
    return PromptFormat.load(DataConfig(train_path="t.jsonl", **data), model_dir)


def test_auto_applies_the_tokenizers_template_with_the_generation_prompt(chat_model):
    text = fmt(chat_model).render_row(GSM8K_ROW)
    assert text == (
        "<|im_start|>user\nWhat is 2+3?\n" + STEP_BY_STEP_BOXED + "<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = fmt(chat_model, system_prompt="Be brief.", instruction="").render_row(GSM8K_ROW)
    assert with_system == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_none_and_a_tokenizer_without_template_give_the_raw_framing(chat_model, tmp_path_factory):
    expected = "Question: What is 2+3?\nAnswer:"
    assert fmt(chat_model, chat_template="none", instruction="").render_row(GSM8K_ROW) == expected
    plain = tmp_path_factory.mktemp("plain")
    no_template = fmt(plain, instruction="")
    assert no_template.render_row(GSM8K_ROW) == expected
    assert "no template" in no_template.template_origin
    math_row = {"problem": "Find x.", "solution": "so \\boxed{3}"}
    math = fmt(plain, dataset=Dataset.math, system_prompt="S")
    assert math.render_row(math_row) == "S\n\nProblem: Find x.\n" + STEP_BY_STEP_BOXED + "\nSolution:"
    assert math.reference(math_row) == "so \\boxed{3}"
    assert math.reference({"problem": "p", "answer": "3", "solution": "long"}) == "3"


def test_a_template_file_replaces_the_tokenizers(chat_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("t") / "mine.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]")
    assert fmt(chat_model, chat_template=str(path), instruction="").render_row(GSM8K_ROW) == (
        "[user] What is 2+3?\n[assistant]"
    )
    with pytest.raises(FileNotFoundError, match="data.chat_template"):
        fmt(chat_model, chat_template="/no/such.jinja")


def test_list_form_templates_and_chat_template_jinja_are_read(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
        )
    )
    assert fmt(tmp_path).render_row(GSM8K_ROW) == "D"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    assert fmt(tmp_path, instruction="").render_row(GSM8K_ROW) == "JWhat is 2+3?"


def test_keys_and_prompt_template_load_other_layouts_and_missing_fields_are_skipped(tmp_path):
    path = tmp_path / "aime.jsonl"
    rows = [
        {"id": 1, "Problem": "Find n.", "Answer": 204, "year": 2024},
        {"id": 2, "Answer": 7, "year": 2024},  # no Problem
        {"id": 3, "Problem": "Find m.", "year": 2024},  # no Answer
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    aime = fmt(tmp_path, dataset=Dataset.math, chat_template="none", prompt_template="({year}) {Problem}",
               answer_key="Answer", instruction="")  # fmt: skip
    kept, report = load_rows(aime, str(path), encode, 512)
    assert [(r.text, r.reference) for r in kept] == [("Problem: (2024) Find n.\nSolution:", "204")]
    assert [s.split(":")[1] for s in report.skipped] == ["2", "3"]
    assert "'Problem'" in report.skipped[0] and "Answer" in report.skipped[1]
    by_key = fmt(
        tmp_path, dataset=Dataset.math, chat_template="none", prompt_key="Problem", answer_key="Answer"
    )
    assert load_rows(by_key, str(path), encode, 512)[0][0].reference == "204"


def test_load_prompts_renders_training_and_held_out_alike(chat_model, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"q{i}?", "answer": f"#### {i}"}) + "\n" for i in range(5))
    )
    data = DataConfig(dataset=Dataset.gsm8k, train_path=str(path), num_eval_prompts=2, instruction="")
    prompts = load_prompts(data, str(chat_model), encode)
    assert prompts.first_prompt == "<|im_start|>user\nq0?<|im_end|>\n<|im_start|>assistant\n"
    assert [p.reference for p in prompts.held_out] == ["3", "4"]
    assert prompts.held_out[0].input_ids == encode("<|im_start|>user\nq3?<|im_end|>\n<|im_start|>assistant\n")
    assert sorted(prompts.stream.at(i).reference for i in range(3)) == ["0", "1", "2"]
    with pytest.raises(ValueError, match="data.num_eval_prompts"):
        load_prompts(
            DataConfig(dataset=Dataset.gsm8k, train_path=str(path), num_eval_prompts=5),
            str(chat_model),
            encode,
        )


def test_the_builtin_task_is_unchanged_without_a_template(tmp_path):
    prompts = load_prompts(DataConfig(num_eval_prompts=1), str(tmp_path), encode)
    from areal_jobs.tasks import arith_task

    assert prompts.first_prompt == arith_task.problem_at(1, 0).prompt
    assert prompts.stream.at(0).input_ids == encode(arith_task.problem_at(1, 0).prompt)
