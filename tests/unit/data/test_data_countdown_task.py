"""The countdown task: problems with several answers, no fixed template that solves many, worked
answers that verify, and its plumbing (prompt stream, held-out set, evaluation set)."""

import itertools
import json
import random

import pytest

from areal_jobs.config import DataConfig, Dataset
from areal_jobs.data import countdown_task
from areal_jobs.data.eval_sets import EvalSet, EvalSetSpec, read_eval_set
from areal_jobs.data.prompts import PromptStream, eval_prompts
from areal_jobs.reward.countdown import evaluate, reward_countdown

PROBLEMS = [countdown_task.problem_at(1, i) for i in range(1000)]


def encode(text):
    return [ord(c) % 250 for c in text]


def test_problems_are_a_pure_function_of_seed_and_index():
    assert countdown_task.problem_at(3, 17) == countdown_task.problem_at(3, 17)
    assert countdown_task.problem_at(3, 17) != countdown_task.problem_at(3, 18)
    assert countdown_task.eval_problem_at(1, 0) != countdown_task.problem_at(1, 0)


def test_every_problem_has_several_distinct_answers():
    for p in PROBLEMS:
        assert countdown_task.MIN_TARGET <= p.target <= countdown_task.MAX_TARGET
        assert len(p.solutions) >= countdown_task.MIN_SOLUTIONS
        assert len({s.canonical() for s in p.solutions}) == len(p.solutions)
        assert len({evaluate(s.expression)[0] for s in p.solutions}) == 1


def test_rearrangements_of_one_answer_count_once():
    a = countdown_task.Attempt(7, 6, "+", 4, "r+z")
    b = countdown_task.Attempt(7, 4, "+", 6, "r+z")
    c = countdown_task.Attempt(6, 4, "*", 7, "r+z")
    assert a.canonical() == b.canonical() != c.canonical()


def test_no_fixed_template_solves_many_problems():
    """The reward must not rise for a trivial reason: the best fixed expression shape over the
    prompt's positions ("n1*n2+n3", ...) solves under a quarter of the problems."""
    best = 0.0
    for order in itertools.permutations(range(3)):
        for op1, op2 in itertools.product("+-*", repeat=2):
            for shape in ("({a}{o}{b}){p}{c}", "{a}{o}({b}{p}{c})"):
                hits = 0
                for prob in PROBLEMS:
                    a, b, c = (prob.numbers[i] for i in order)
                    text = shape.format(a=a, b=b, c=c, o=op1, p=op2)
                    hits += reward_countdown(f"answer: {text}", prob.reference).reward
                best = max(best, hits / len(PROBLEMS))
    assert best < 0.25, best


@pytest.mark.parametrize("seed", range(3))
def test_worked_answers_verify_and_attempts_are_honest(seed):
    rng = random.Random(seed)
    for p in PROBLEMS[:200]:
        text = countdown_task.worked_solution(p, rng)
        assert reward_countdown(text, p.reference).reward == 1.0
        tries = text.split(" try ")[1:]
        assert tries[-1].endswith(f"yes. answer: {tries[-1].split(':')[0]}")
        for t in tries:  # every attempt's arithmetic is right, and "yes" only on the target
            expression, rest = t.split(": ", 1)
            value = evaluate(expression)[0]
            assert f"={value} " in rest
            assert (" yes." in rest) == (value == p.target)


def test_stream_and_held_out_prompts():
    data = DataConfig(dataset=Dataset.countdown, seed=1, num_eval_prompts=3)
    stream = PromptStream(data, encode)
    first = stream.next()
    assert first.reward_task == "countdown" and first.data_index == 0
    assert json.loads(first.reference)["target"] == countdown_task.problem_at(1, 0).target
    held_out = eval_prompts(data, encode)
    assert [json.loads(p.reference) for p in held_out] == [
        json.loads(countdown_task.eval_problem_at(1, i).reference) for i in range(3)
    ]
    prompts, report = read_eval_set(EvalSetSpec(EvalSet.countdown, limit=3), encode, 512)
    assert [p.reference for p in prompts] == [p.reference for p in held_out] and report.num_rows == 3


def test_the_habit_avoids_pair_products_and_gives_up_where_only_they_solve():
    """The warm start's misconception (phase 2): a worker with the habit never tries "(x*y)...";
    it answers right exactly on the problems that have a solution without a pair product."""
    rng = random.Random(0)
    right = 0
    for p in PROBLEMS[:400]:
        text = countdown_task.worked_solution(p, rng, habit_rate=1.0)
        solvable = any(s.op != countdown_task.HABIT_AVOIDS_OP for s in p.solutions)
        tries = [t.split(":")[0] for t in text.split(" try ")[1:]]
        assert not any(t[2] == "*" for t in tries), text  # "(x*y)" never tried
        got = reward_countdown(text, p.reference).reward
        assert got == float(solvable)
        if not solvable:
            assert len(tries) == countdown_task.MAX_GIVE_UP_TRIES and " yes." not in text
        right += got
    assert 0.6 < right / 400 < 0.85  # about a quarter of the problems need a product
