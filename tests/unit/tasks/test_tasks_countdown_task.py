"""The countdown task: problems with several answers, no fixed template that solves many, worked
answers that verify, and its plumbing (prompt stream, held-out set, evaluation set)."""

import itertools
import json
import random
import re

import pytest

from areal_jobs.config import DataConfig, Dataset
from areal_jobs.data.eval_sets import EvalSet, EvalSetSpec, read_eval_set
from areal_jobs.data.prompts import PromptStream, eval_prompts
from areal_jobs.reward.countdown import evaluate, reward_countdown
from areal_jobs.tasks import countdown_task

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
def test_guided_answers_verify_and_attempts_are_honest(seed):
    rng = random.Random(seed)
    for p in PROBLEMS[:200]:
        text = countdown_task.guided_solution(p, rng)
        assert reward_countdown(text, p.reference).reward == 1.0
        tries = text.split(" try ")[1:]
        assert len(tries) <= 4
        assert tries[-1].endswith(f"yes. answer: {tries[-1].split(':')[0]}")
        _assert_honest(tries, p.target)


def _assert_honest(tries: list[str], target: int) -> None:
    for t in tries:  # every attempt's arithmetic is right, and "yes" only on the target
        expression, rest = t.split(": ", 1)
        value = evaluate(expression)[0]
        assert f"={value} " in rest
        assert (" yes." in rest) == (value == target)


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


def test_the_searching_worker_tries_at_most_max_tries_in_random_order():
    """Phase 2's worker: distinct candidates in random order, stops at the first hit or after
    MAX_TRIES ("answer: none", 0 reward); it solves about the share that MAX_TRIES random draws
    of a problem's candidates hit (0.48 over these problems), and its first tries use every
    pair operation (no order a policy could copy from it)."""
    rng = random.Random(0)
    right, first_ops, num_problems = 0.0, set(), 600
    for p in PROBLEMS[:num_problems]:
        text = countdown_task.search_solution(p, rng)
        tries = text.split(" try ")[1:]
        expressions = [t.split(":")[0] for t in tries]
        assert len(set(expressions)) == len(expressions) <= countdown_task.MAX_TRIES
        _assert_honest(tries, p.target)
        got = reward_countdown(text, p.reference).reward
        assert got == float(" yes." in text)
        if not got:
            assert len(tries) == min(countdown_task.MAX_TRIES, len(countdown_task.attempts(p.numbers)))
            assert text.endswith(f" answer: {countdown_task.NO_ANSWER}")
        right += got
        first_ops.add(re.search(r"\(\d([-+*])\d\)", expressions[0]).group(1))
    assert 0.40 < right / num_problems < 0.56
    assert first_ops == set(countdown_task.PAIR_OPS)
