"""Static HumanEval reference checks (nothing runs): grader errors found at data-load time, and
prompts that end at the signature made loadable."""

from __future__ import annotations

import json

import pytest

from areal_jobs.reward.code import check_humaneval_references, humaneval_reference_problem, loadable_prompt

TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n"


def ref(prompt: str = "def add(a, b):\n", test: str = TEST, entry_point: str = "add") -> str:
    return json.dumps({"prompt": prompt, "test": test, "entry_point": entry_point})


@pytest.mark.parametrize(
    ("prompt", "loadable"),
    [
        ("def add(a, b):\n", "def add(a, b):\n    pass\n"),
        ("import math\n\n\ndef add(a, b):", "import math\n\n\ndef add(a, b):\n    pass\n"),
        ("class A:\n    def add(self, b):\n", "class A:\n    def add(self, b):\n        pass\n"),
        ('def add(a, b):\n    """Sum."""\n', 'def add(a, b):\n    """Sum."""\n'),  # compiles: unchanged
        ("def add(a, b:\n", "def add(a, b:\n"),  # `pass` cannot help: unchanged
    ],
)
def test_loadable_prompt(prompt: str, loadable: str) -> None:
    assert loadable_prompt(prompt) == loadable


@pytest.mark.parametrize(
    ("reference", "problem"),
    [
        (ref(), ""),
        (ref(prompt='def add(a, b):\n    """Sum."""\n'), ""),
        (ref(test="def check(candidate:\n"), "prompt + test do not compile"),
        (ref(entry_point="plus"), "prompt defines no entry point 'plus'"),
        (ref(test="def verify(candidate):\n    pass\n"), "test defines no check(candidate)"),
        ("not json", "reference is not JSON"),
    ],
)
def test_reference_problem(reference: str, problem: str) -> None:
    found = humaneval_reference_problem(reference)
    assert found.startswith(problem) and bool(found) == bool(problem), found


def test_data_load_check_names_the_broken_rows() -> None:
    check_humaneval_references([ref(), ref()], "good.jsonl")
    with pytest.raises(
        ValueError, match=r"1 of 3 HumanEval references in bad.jsonl .*row 1: prompt defines no"
    ):
        check_humaneval_references([ref(), ref(entry_point="plus"), ref()], "bad.jsonl")
