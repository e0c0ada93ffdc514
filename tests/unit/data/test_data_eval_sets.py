"""Evaluation-set readers on the real layouts: GSM8K and HumanEval rows (tests/fixtures, copied
from the public sets), MATH-500 / AIME-style JSONL with configurable field names, stdin/stdout
code sets. Each prompt is scored by its reward function against the set's own gold answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_jobs.data.eval_sets import EvalSet, EvalSetSpec, detect_kind, read_eval_set
from areal_jobs.reward.registry import resolve

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
GSM8K = FIXTURES / "gsm8k" / "test_head50.jsonl"
HUMANEVAL = FIXTURES / "humaneval" / "humaneval_head20.jsonl"


def encode(text: str) -> list[int]:
    return list(text.encode())


def decode(ids: list[int]) -> str:
    return bytes(ids).decode()


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_gsm8k_rows_become_question_prompts_scored_against_the_hash_answer():
    prompts, report = read_eval_set(EvalSetSpec(EvalSet.gsm8k, str(GSM8K), limit=5), encode, 4096)
    assert len(prompts) == 5 and report.num_rows == 50 and not report.skipped
    first = prompts[0]  # Janet's ducks: "#### 18"
    assert decode(first.input_ids).startswith("Question: Janet") and decode(first.input_ids).endswith(
        "Answer:"
    )
    assert first.reference == "18" and first.reward_task == "gsm8k"
    assert [p.data_index for p in prompts] == [-1, -2, -3, -4, -5]
    reward = resolve(first.reward_task)
    assert reward("so she makes 9*2 = 18 dollars.\n#### 18", first.reference).reward == 1.0
    assert reward("#### 17", first.reference).reward == 0.0


def test_math_layouts_with_configurable_fields(tmp_path):
    math500 = write_jsonl(
        tmp_path / "math500.jsonl",
        [
            {"problem": "What is $1+1$?", "solution": "It is $\\boxed{2}$.", "answer": "2"},
            {"problem": "Simplify $\\frac{2}{4}$.", "answer": "\\frac{1}{2}"},
            {"problem": "no answer here"},  # skipped, reported with its line
            "not json",
        ],
    )
    prompts, report = read_eval_set(EvalSetSpec(EvalSet.math, math500), encode, 4096)
    assert [p.reference for p in prompts] == ["2", "\\frac{1}{2}"]
    # the same prompt as training builds: the MATH layout appends its default instruction
    assert decode(prompts[0].input_ids) == (
        "Problem: What is $1+1$?\nPlease reason step by step, and put your final answer within \\boxed{}.\nSolution:"
    )
    assert report.num_rows == 4 and len(report.skipped) == 2 and "math500.jsonl:3" in report.skipped[0]
    assert resolve("math")("so \\boxed{0.5}", prompts[1].reference).reward == 1.0

    aime = write_jsonl(tmp_path / "aime.jsonl", [{"ID": "2024-I-1", "Problem": "Find x.", "Answer": 204}])
    spec = EvalSetSpec(EvalSet.math, aime, problem_field="Problem", answer_field="Answer")
    prompts, _ = read_eval_set(spec, encode, 4096)
    assert prompts[0].reference == "204"  # integer answers become text
    with pytest.raises(ValueError, match="no usable rows"):
        read_eval_set(EvalSetSpec(EvalSet.math, aime), encode, 4096)  # default names: no usable row


def test_math_answer_may_be_a_boxed_solution(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"problem": "p", "solution": "so $\\boxed{42}$"}])
    prompts, _ = read_eval_set(EvalSetSpec(EvalSet.math, path, answer_field="solution"), encode, 4096)
    assert resolve("math")("\\boxed{42}", prompts[0].reference).reward == 1.0


def test_humaneval_prompts_carry_the_tests_and_the_canonical_solution_passes():
    prompts, _ = read_eval_set(EvalSetSpec(EvalSet.humaneval, str(HUMANEVAL), limit=2), encode, 8192)
    rows = [json.loads(line) for line in HUMANEVAL.read_text().splitlines()[:2]]
    assert [decode(p.input_ids) for p in prompts] == [r["prompt"] for r in rows]
    assert resolve("humaneval")(rows[0]["canonical_solution"], prompts[0].reference).reward == 1.0
    assert resolve("humaneval")("    return None\n", prompts[0].reference).reward == 0.0


def test_stdio_code_sets(tmp_path):
    path = write_jsonl(
        tmp_path / "code.jsonl",
        [{"prompt": "Read n, print 2n.", "tests": [{"input": "3\n", "output": "6\n"}]}],
    )
    assert detect_kind(path) is EvalSet.code_stdio
    prompts, _ = read_eval_set(EvalSetSpec(EvalSet.code_stdio, path), encode, 4096)
    assert (
        prompts[0].reward_task == "code_stdio"
        and json.loads(prompts[0].reference)["tests"][0]["output"] == "6\n"
    )


def test_builtin_set_is_the_runs_held_out_problems():
    prompts, _ = read_eval_set(EvalSetSpec(EvalSet.builtin, limit=3), encode, 4096)
    assert len(prompts) == 3 and all(p.reward_task == "arith" for p in prompts)
    again, _ = read_eval_set(EvalSetSpec(EvalSet.builtin, limit=3), encode, 4096)
    assert [p.input_ids for p in again] == [p.input_ids for p in prompts]


def test_detect_kind_reads_the_first_row(tmp_path):
    assert detect_kind(str(GSM8K)) is EvalSet.gsm8k
    assert detect_kind(str(HUMANEVAL)) is EvalSet.humaneval
    assert detect_kind(write_jsonl(tmp_path / "m.jsonl", [{"problem": "p", "answer": "1"}])) is EvalSet.math
    with pytest.raises(ValueError, match="needs a JSONL path"):
        EvalSetSpec(EvalSet.gsm8k)
