"""The countdown verifier (reward/countdown.py): right answers earn 1 and every loophole 0,
through the registry as the reward service loads it."""

import json

import pytest

from areal_jobs.api import RewardStatus
from areal_jobs.reward.countdown import evaluate, is_solution
from areal_jobs.reward.registry import resolve
from areal_jobs.tasks import countdown_task

REF = json.dumps({"numbers": [7, 6, 4], "target": 38})
reward = resolve("countdown")


@pytest.mark.parametrize(
    "response",
    [
        " 7+6=13 7*6=42 (4); ... try (7*6)-4: 42-4=38 yes. answer: (7*6)-4",
        "answer: 7*6-4",
        "answer: 6*7-4.",
        "answer:  ( 6 * 7 ) - 4 \nmore text on the next line",
        "answer: ((7*6))-4",
        "answer: 6*(7)-4",
    ],
)
def test_right_answers_earn_one(response):
    assert reward(response, REF).reward == 1.0


@pytest.mark.parametrize(
    "response, why",
    [
        ("answer: 38", "the target alone uses no given number"),
        ("answer: 7*6-4+0", "a number not given (0)"),
        ("answer: 7*6-4*1", "a number not given (1)"),
        ("answer: 7*6", "a given number unused"),
        ("answer: 7*6-4-4+4", "a number used twice"),
        ("answer: 76-38", "digit concatenation makes new numbers"),
        ("answer: 7*6-4 = 38", "trailing text"),
        ("answer: 7*6-5", "wrong value"),
        ("answer: -4+7*6", "unary minus"),
        ("answer: +7*6-4", "unary plus"),
        ("answer: 7**2-4-7", "power"),
        ("answer: 7*6/1-4", "division"),
        ("answer: 7.0*6-4", "decimals"),
        ("answer: 07*6-4", "leading zero"),
        ("answer: ７*6-4", "non-ASCII digit"),
        ("answer: __import__('os').system('true')", "code"),
        ("answer: (7*6-4", "unbalanced"),
        ("answer: 7*6)-4", "unbalanced"),
        ("answer: ", "empty"),
        ("7*6-4", "no answer marker"),
        ("answer: 7*6-4. answer: 1", "two markers"),
        ("answer: 7*6-5\nanswer: 7*6-4", "two markers, the right one second"),
        ("answer: " + "(" * 9 + "7*6-4" + ")" * 9, "nesting past the bound"),
        ("answer: " + "7*6-4+" + "+".join(["0"] * 40), "longer than the bound"),
    ],
)
def test_loopholes_earn_zero(response, why):
    result = reward(response, REF)
    assert result.reward == 0.0, why
    assert result.status in (RewardStatus.ok, RewardStatus.parse_error)


def test_parse_errors_say_so():
    result = reward("no answer here", REF)
    assert result.status is RewardStatus.parse_error and "answer:" in result.detail


def test_exact_integer_arithmetic_and_precedence():
    assert evaluate("2+3*4") == (14, [2, 3, 4])
    assert evaluate("(2+3)*4") == (20, [2, 3, 4])
    assert evaluate("9-5-3") == (1, [9, 5, 3])  # left to right
    assert evaluate("9-(5-3)") == (7, [9, 5, 3])


@pytest.mark.parametrize("index", range(300))
def test_every_listed_solution_verifies(index):
    problem = countdown_task.problem_at(1, index)
    assert len(problem.solutions) >= countdown_task.MIN_SOLUTIONS
    for att in problem.solutions:
        assert is_solution(att.expression, list(problem.numbers), problem.target)
        assert reward(f"answer: {att.expression}", problem.reference).reward == 1.0
