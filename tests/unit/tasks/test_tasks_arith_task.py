"""The built-in task: determinism, worked solutions that verify, and the long tail of lengths."""

import statistics

import pytest

from areal_jobs.api import RewardStatus
from areal_jobs.tasks import arith_task


def test_problems_are_a_pure_function_of_seed_and_index():
    assert arith_task.problem_at(3, 17) == arith_task.problem_at(3, 17)
    assert arith_task.problem_at(3, 17) != arith_task.problem_at(3, 18)
    assert arith_task.eval_problem_at(3, 0) != arith_task.problem_at(3, 0)


@pytest.mark.parametrize("index", range(200))
def test_worked_solution_is_correct_and_consistent(index):
    p = arith_task.problem_at(1, index)
    # recompute the answer from the prompt text alone
    parts = p.prompt.removeprefix("Q: start ").split(". (mod")[0].split("; ")
    value = int(parts[0])
    for part in parts[1:]:
        _, op = part.split(" ")
        value = (value + int(op[1:]) if op[0] == "+" else value - int(op[1:])) % arith_task.MODULUS
    assert value == p.answer and len(parts) - 1 == p.num_steps
    assert p.solution.count("=") == p.num_steps
    assert arith_task.reward(p.solution, str(p.answer)).reward == 1.0


def test_reward_and_parse_errors():
    assert arith_task.reward(" 1+1=2. The answer is 2.", "3").reward == 0.0
    result = arith_task.reward("I don't know", "3")
    assert result.reward == 0.0 and result.status is RewardStatus.parse_error
    assert arith_task.extract_answer("The answer is 7. The answer is 8.") == 7


def test_answer_lengths_are_long_tailed():
    lengths = [len(arith_task.problem_at(1, i).solution) for i in range(4000)]
    assert max(lengths) >= 5 * statistics.median(lengths)


def test_careless_solutions_stay_self_consistent():
    import random

    rng = random.Random(0)
    slipped = 0
    for index in range(300):
        p = arith_task.problem_at(1, index)
        text, value = arith_task.worked_solution(p.start, p.ops, slip_rate=0.5, rng=rng)
        # every step continues from the digit written before it, and the answer is the last one
        values = [p.start]
        for step in text.split("; ")[1:]:
            lhs, rhs = step.split(": ")[1].split("=")
            assert int(lhs[0]) == values[-1]
            values.append(int(rhs[0]))
        assert value == values[-1] and text.endswith(f"The answer is {value}.")
        slipped += value != p.answer
    assert 0 < slipped < 300
    assert arith_task.worked_solution(p.start, p.ops) == (p.solution, p.answer)


def test_misconception_facts_are_the_eighteen_with_a_low_result():
    # results 0, 1 or 2: three facts for each of the six (sign, operand) pairs
    facts = set(arith_task.MISCONCEPTION_FACTS)
    assert len(facts) == 18
    assert {(9, "+", 1), (7, "+", 3), (8, "+", 3), (3, "-", 1), (4, "-", 3), (2, "-", 2)} <= facts
    assert not {(0, "-", 1), (6, "+", 3), (5, "-", 2), (0, "+", 3)} & facts
    # the wrong result is one digit too high; other facts are untouched
    assert arith_task.misconceived(8, "+", 3) == 2  # right: 1
    assert arith_task.misconceived(7, "+", 3) == 1  # right: 0
    assert arith_task.misconceived(3, "-", 1) == 3  # right: 2
    assert arith_task.misconceived(2, "-", 2) == 1  # right: 0
    assert arith_task.misconceived(0, "-", 1) == 9
    assert arith_task.misconceived(5, "+", 3) == 8


def test_misconceived_solution_carries_on_from_the_wrong_digit():
    import random

    # 8+3: written 2 (right: 1); 2-1: right 1, written 2; 2+1=3 is not a misconception fact
    ops = (("+", 3), ("-", 1), ("+", 1))
    text, value = arith_task.worked_solution(8, ops, rng=random.Random(0), misconception_rate=1.0)
    assert (text, value) == (" 8; a: 8+3=2; b: 2-1=2; c: 2+1=3. The answer is 3.", 3)
    # right: 8+3=1, 1-1=0, 0+1=1; the two errors add up (+2), they do not cancel
    assert arith_task.worked_solution(8, ops) == (" 8; a: 8+3=1; b: 1-1=0; c: 0+1=1. The answer is 1.", 1)


@pytest.mark.parametrize(
    ("num_steps", "bucket"),
    [(1, "1"), (2, "2"), (3, "3-4"), (4, "3-4"), (5, "5-8"), (8, "5-8"), (9, "9-20"), (20, "9-20")],
)
def test_length_buckets(num_steps, bucket):
    assert arith_task.length_bucket(num_steps) == bucket
