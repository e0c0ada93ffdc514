"""The committed warm start (areal_jobs/tasks/models/builtin_model) holds the misconception RL must unlearn.

Read off the model's own next-digit distribution (tasks/warm_start/fact_probe.py) for all 60 arithmetic facts:
greedy is wrong on the 18 misconception facts and right on the others, while the right digit keeps
a minority of the probability there, so sampling finds it and the reward can teach it. Seconds on
CPU: one forward pass of the tiny model.
"""

import json

import pytest

from areal_jobs.tasks import arith_task
from areal_jobs.tasks.warm_start import fact_probe
from areal_jobs.tasks.warm_start.tiny_model import PACKAGED_DIR, TinyRecipe


@pytest.fixture(scope="module")
def beliefs() -> list[fact_probe.FactBelief]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fact_probe.probe(*fact_probe.load(PACKAGED_DIR))
    finally:
        torch.set_num_threads(threads)


def test_committed_model_is_the_default_recipe():
    # launch.local refuses a committed model built from another recipe; this names the fix early
    built = json.loads((PACKAGED_DIR / "build.json").read_text())["recipe"]
    assert built == TinyRecipe().__dict__, "rebuild: python -m areal_jobs.tasks.warm_start.tiny_model"


def test_greedy_is_wrong_on_every_misconception_fact(beliefs):
    misconceived = [b for b in beliefs if b.misconception]
    assert len(misconceived) == 18
    wrong = [f"{b.value}{b.sign}{b.operand}={b.greedy}" for b in misconceived if b.greedy == b.right]
    assert not wrong, f"the warm start gets these misconception facts right: {wrong}"
    # and wrong *the misconceived way*: one digit too high
    assert sum(b.greedy == arith_task.misconceived(b.value, b.sign, b.operand) for b in misconceived) >= 15


def test_greedy_is_right_on_the_other_facts(beliefs):
    others = [b for b in beliefs if not b.misconception]
    wrong = [f"{b.value}{b.sign}{b.operand}={b.greedy}" for b in others if b.greedy != b.right]
    assert len(wrong) <= 2, f"the warm start is wrong on non-misconception facts: {wrong}"


def test_the_right_answer_keeps_a_minority_that_sampling_finds(beliefs):
    """RL has something to learn: on each misconception fact the right digit is less likely than
    the misconceived one (so sharpening alone makes it worse) but likely enough that a group of 8
    samples over a few steps contains it (so the reward can favour it)."""
    for b in (b for b in beliefs if b.misconception):
        assert 0.05 < b.p_right < b.p_misconceived, (b.value, b.sign, b.operand, b.p_right, b.p_misconceived)
    summary = fact_probe.summarize(beliefs)
    assert summary["misconception"]["p_right"] < 0.5 < summary["other"]["greedy_right"]


def test_most_held_out_problems_need_a_misconception_fact():
    """The misconception is not a corner case: 30% of all steps are misconception facts, so over the
    long-tailed lengths about half of the held-out answers can only be right once it is unlearned."""
    problems = [arith_task.eval_problem_at(1, i) for i in range(2000)]

    def needs_it(p: arith_task.ArithProblem) -> bool:
        value = p.start
        for sign, operand in p.ops:
            if arith_task.is_misconception(value, sign, operand):
                return True
            value = (value + operand if sign == "+" else value - operand) % arith_task.MODULUS
        return False

    share = sum(map(needs_it, problems)) / len(problems)
    assert 0.4 < share < 0.65
