"""The built-in task: multi-step arithmetic with a worked chain of thought.

A problem is a start value and k single-digit additions/subtractions; the answer walks through
every step and ends with "The answer is N." Example (k = 3):

    prompt:   "Q: 12+7-3+8\nA:"
    solution: " 12+7=19, 19-3=16, 16+8=24. The answer is 24."

The number of steps k is long-tailed (P(k) ~ k^-1.5 on 1..MAX_STEPS): most answers are short,
a few are ~10x longer. That tail is what makes synchronous RL wait for stragglers. Problems are a
pure function of (seed, index), so the prompt stream is reproducible and resumable.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from areal_jobs.api import RewardResult, RewardStatus

MAX_STEPS = 24
_STEP_WEIGHTS = [k**-1.5 for k in range(1, MAX_STEPS + 1)]
_ANSWER_RE = re.compile(r"The answer is (-?\d+)\.")
EVAL_SEED_OFFSET = 1_000_003  # held-out problems come from a disjoint seed stream


@dataclass(frozen=True)
class ArithProblem:
    prompt: str
    solution: str  # the worked chain of thought, including the final sentence
    answer: int
    num_steps: int


def problem_at(seed: int, index: int) -> ArithProblem:
    """The `index`-th problem of the stream `seed`: deterministic, O(1) to reach any index."""
    rng = random.Random(seed * 1_000_000_007 + index)
    num_steps = rng.choices(range(1, MAX_STEPS + 1), weights=_STEP_WEIGHTS)[0]
    value = rng.randint(0, 99)
    expr, steps = str(value), []
    for _ in range(num_steps):
        operand = rng.randint(1, 9)
        # keep the running value in 0..99 so every step is a two-digit fact
        can_add, can_sub = value + operand <= 99, value - operand >= 0
        add = can_add if not (can_add and can_sub) else rng.random() < 0.5
        new = value + operand if add else value - operand
        sign = "+" if add else "-"
        expr += f"{sign}{operand}"
        steps.append(f"{value}{sign}{operand}={new}")
        value = new
    solution = " " + ", ".join(steps) + f". The answer is {value}."
    return ArithProblem(prompt=f"Q: {expr}\nA:", solution=solution, answer=value, num_steps=num_steps)


def eval_problem_at(seed: int, index: int) -> ArithProblem:
    return problem_at(seed + EVAL_SEED_OFFSET, index)


def extract_answer(response: str) -> int | None:
    """The integer in the first "The answer is N." sentence, or None."""
    match = _ANSWER_RE.search(response)
    return int(match.group(1)) if match else None


def reward(response: str, reference: str) -> RewardResult:
    """Reward 1 when the stated final answer equals `reference` (an integer as text), else 0."""
    got = extract_answer(response)
    if got is None:
        return RewardResult(0.0, RewardStatus.parse_error, "no 'The answer is N.' sentence")
    return RewardResult(1.0 if got == int(reference) else 0.0)
