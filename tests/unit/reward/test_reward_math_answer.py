"""Math reward: extraction, normalisation, the equivalence table, and GSM8K gold solutions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from areal_jobs.api import RewardResult, RewardStatus
from areal_jobs.reward.math_answer import (
    answers_match,
    extract_final_answer,
    normalise_answer,
    reward_math,
)

REPO = Path(__file__).resolve().parents[3]
SHARED_GSM8K = REPO / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"
FIXTURE_GSM8K = REPO / "tests" / "fixtures" / "gsm8k" / "test_head50.jsonl"

# (response text, extracted final answer or None)
EXTRACTION = [
    ("so the total is \\boxed{42}.", "42"),
    ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("$\\boxed{\\sqrt{\\frac{a}{b}}}$", "\\sqrt{\\frac{a}{b}}"),
    ("the answer: \\boxed 5$", "5"),
    ("\\fbox{x=3}", "x=3"),
    ("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18", "18"),
    ("#### 1,000\n", "1,000"),
    ("The answer is 18.", "18"),  # the sentence's full stop is not part of the answer
    ("The answer is **18**.", "18"),
    ("**The answer is 18.**", "18"),
    ("Final Answer: The final answer is 18. I hope it is correct.", "18"),
    ("Final Answer: 18", "18"),
    ("The answer is 18 dollars per week.", "18 dollars per week"),
    ("The answer is 3.5. Done.", "3.5"),  # a decimal point is not a sentence end
    ("\\boxed{5!}", "5!"),
    ("Thus the answer is: $\\frac{1}{2}$", "$\\frac{1}{2}$"),
    ("I computed 7 + 5 = 12 apples.", None),
    ("unfinished \\boxed{12", None),
    ("\\boxed{ } is empty", None),
    ("", None),
]

# (prediction, gold, equivalent?) -- every verdict here is what a careful grader would say.
EQUIVALENCE = [
    ("1/2", "0.5", True),
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac12", "1/2", True),
    ("\\tfrac{1}{2}", "\\frac12", True),
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("1,000", "1000", True),
    ("1{,}000", "1000", True),
    ("1\\,000", "1000", True),
    ("1,000,000", "10^6", True),
    ("\\$18", "18", True),
    ("18 dollars", "18", True),
    ("5\\text{ cm}", "5", True),
    ("90^\\circ", "90", True),
    ("50\\%", "50", True),
    ("x = 3", "3", True),
    ("3.50", "3.5", True),
    (".5", "1/2", True),
    ("42.", "42", True),
    ("6", "6.0", True),
    ("-\\frac{3}{4}", "-0.75", True),
    ("\\frac{-3}{4}", "-3/4", True),
    ("\\left( 1, 2 \\right)", "(1,2)", True),
    ("[1, 2)", "[1,2)", True),
    ("(-\\infty, 3]", "(-\\infty,3]", True),
    ("\\{3, 2, 1\\}", "\\{1,2,3\\}", True),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("2\\pi", "\\pi \\cdot 2", True),
    ("\\text{(C)}", "C", True),
    ("\\text{Evelyn}", "Evelyn", True),
    ("$\\frac{7}{3}$", "\\dfrac{7}{3}", True),
    # non-equivalences, several of them near misses
    ("[1,2)", "[1,2]", False),
    ("(1,2)", "[1,2]", False),
    ("(1,2)", "(2,1)", False),
    ("1/3", "0.333", False),
    ("0.33", "\\frac{1}{3}", False),
    ("2", "-2", False),
    ("\\frac{1}{2}", "\\frac{2}{1}", False),
    ("1,000", "1.000", False),
    ("1,2", "12", False),
    ("x+1", "x-1", False),
    ("\\sqrt{2}", "2", False),
    ("2\\sqrt{3}", "\\sqrt{6}", False),
    ("\\pi", "3.14", False),
    ("x^2", "2x", False),
    ("5 cm", "50", False),
    ("10", "100", False),
    ("\\infty", "-\\infty", False),
    ("1/0", "0", False),
    ("", "0", False),
    ("18", "\\text{Evelyn}", False),
    # factorials: '!' is an operator, not punctuation
    ("5!", "120", True),
    ("3!", "6", True),
    ("4!", "4", False),
    ("5!", "5", False),
    ("18 dollars per week", "18", True),
    ("60 km/h", "60", True),
    ("18 dollars per week", "19", False),
]


def test_equivalence_table_is_big_enough() -> None:
    assert len(EQUIVALENCE) >= 40
    assert sum(1 for *_, same in EQUIVALENCE if not same) >= 15


@pytest.mark.parametrize(("text", "expected"), EXTRACTION)
def test_extract_final_answer(text: str, expected: str | None) -> None:
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        ("$1,000$", "1000"),
        ("\\( \\dfrac{3}{4} \\)", "\\frac{3}{4}"),
        ("\\frac12", "\\frac{1}{2}"),
        ("\\left[ 1, 2 \\right)", "[ 1, 2 )"),
        ("12 \\text{ inches}.", "12"),
        ("45^{\\circ}", "45"),
        ("y = 2x + 1", "2x + 1"),
        ("(B)", "B"),
    ],
)
def test_normalise_answer(raw: str, normalised: str) -> None:
    assert normalise_answer(raw) == normalised


@pytest.mark.parametrize(("pred", "gold", "same"), EQUIVALENCE)
def test_equivalence(pred: str, gold: str, same: bool) -> None:
    assert answers_match(pred, gold) is same
    assert answers_match(gold, pred) is same  # the verdict must not depend on the argument order


@pytest.mark.parametrize(
    ("response", "gold", "reward"),
    [
        ("\\boxed{5!}", "120", 1.0),
        ("\\boxed{4!}", "4", 0.0),
        ("So \\boxed{4!} ways.", "24", 1.0),
        ("The answer is **72**.", "72", 1.0),
        ("**The answer is 72.**", "72", 1.0),
        ("Final Answer: The final answer is 72. I hope it is correct.", "72", 1.0),
        ("Final Answer: The final answer is 71. I hope it is correct.", "72", 0.0),
        ("The answer is 72 dollars per week.", "72", 1.0),
        ("The answer is 73 dollars per week.", "72", 0.0),
        ("The answer is **$\\frac{1}{2}$**.", "0.5", 1.0),
    ],
)
def test_issue_12_final_answer_formats(response: str, gold: str, reward: float) -> None:
    result = reward_math(response, gold)
    assert (result.reward, result.status) == (reward, RewardStatus.ok)


def test_reward_statuses() -> None:
    assert reward_math("so \\boxed{\\frac{1}{2}}", "0.5") == RewardResult(1.0, RewardStatus.ok, "equivalent")
    wrong = reward_math("The answer is 3.", "4")
    assert (wrong.reward, wrong.status) == (0.0, RewardStatus.ok)
    missing = reward_math("I think it is 4", "4")
    assert (missing.reward, missing.status) == (0.0, RewardStatus.parse_error)
    # a reference can be a whole gold solution that marks its answer
    assert reward_math("#### 72", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72").reward == 1.0


def test_verifier_timeout_is_reported_not_zeroed(monkeypatch: pytest.MonkeyPatch) -> None:
    from math_verify.errors import TimeoutException

    def too_slow(*args: object, **kwargs: object) -> bool:
        raise TimeoutException("Operation timed out!")

    monkeypatch.setattr("math_verify.verify", too_slow)
    result = reward_math("\\boxed{2\\sqrt{2}}", "\\sqrt{8}")
    assert (result.reward, result.status) == (0.0, RewardStatus.timeout)


def test_model_output_never_reaches_python_eval() -> None:
    # sympy's parse_expr evaluates Python; math-verify's plain-expression parser uses it.
    payload = "__import__('os').system('touch /tmp/areal_math_pwned')"
    assert reward_math(f"\\boxed{{{payload}}}", "0").reward == 0.0
    assert not Path("/tmp/areal_math_pwned").exists()


def _gsm8k_rows() -> list[dict]:
    if not SHARED_GSM8K.exists():
        pytest.skip(f"shared GSM8K data not found at {SHARED_GSM8K} (CI has shared/ beside the checkout)")
    return [json.loads(line) for line in SHARED_GSM8K.read_text().splitlines()]


def _check_gold_and_corrupted(rows: list[dict]) -> None:
    assert rows
    for row in rows:
        solution = row["answer"]
        gold = solution.split("####")[-1].strip()
        assert reward_math(solution, gold).reward == 1.0, row["question"][:80]
        number = re.search(r"-?[\d,]*\d(?:\.\d+)?\s*$", solution)
        assert number is not None, solution[-40:]
        changed = int(number.group().replace(",", "").split(".")[0]) + 1
        corrupted = solution[: number.start()] + str(changed)
        assert reward_math(corrupted, gold).reward == 0.0, corrupted[-40:]


def test_gsm8k_fixture_gold_solutions_score_one_and_changed_answers_zero() -> None:
    rows = [json.loads(line) for line in FIXTURE_GSM8K.read_text().splitlines()]
    assert len(rows) == 50
    _check_gold_and_corrupted(rows)


def test_gsm8k_all_gold_solutions_score_one_and_changed_answers_zero() -> None:
    rows = _gsm8k_rows()
    assert len(rows) == 1000
    _check_gold_and_corrupted(rows)
