"""The built-in task: multi-step modular arithmetic with a worked chain of thought.

A problem names a start digit and k single-digit additions/subtractions, all modulo 10, each
step labelled by a letter. The worked answer takes the steps in order, so each step only needs
the previous result and the labelled operation. Example (k = 3):

    prompt:   "Q: start 7; a +3; b -9; c +2. (mod 10)\nA:"
    solution: " 7; a: 7+3=0; b: 0-9=1; c: 1+2=3. The answer is 3."

The number of steps k is long-tailed (P(k) ~ k^-1.5 on 1..MAX_STEPS): most answers are short,
a few are 6x longer or more. That tail is what makes synchronous RL wait for stragglers.
Problems are a pure function of (seed, index), so the prompt stream is reproducible and resumable.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

from areal_jobs.api import RewardResult, RewardStatus

MAX_STEPS = 20
MODULUS = 10
MAX_OPERAND = 3  # operands 1..3: 60 arithmetic facts, learnable by a tiny model in a short warm start
_LABELS = string.ascii_lowercase[:MAX_STEPS]
_STEP_WEIGHTS = [k**-1.5 for k in range(1, MAX_STEPS + 1)]
_ANSWER_RE = re.compile(r"The answer is (-?\d+)\.")
EVAL_SEED_OFFSET = 1_000_003  # held-out problems come from a disjoint seed stream


@dataclass(frozen=True)
class ArithProblem:
    prompt: str
    solution: str  # the worked chain of thought, including the final sentence
    answer: int
    num_steps: int
    start: int
    ops: tuple[tuple[str, int], ...]  # (sign, operand) per step


def problem_at(seed: int, index: int) -> ArithProblem:
    """The `index`-th problem of the stream `seed`: deterministic, O(1) to reach any index."""
    rng = random.Random(seed * 1_000_000_007 + index)
    num_steps = rng.choices(range(1, MAX_STEPS + 1), weights=_STEP_WEIGHTS)[0]
    start = rng.randint(0, MODULUS - 1)
    ops = tuple((rng.choice("+-"), rng.randint(1, MAX_OPERAND)) for _ in range(num_steps))
    listed = "; ".join(f"{label} {sign}{operand}" for label, (sign, operand) in zip(_LABELS, ops))
    prompt = f"Q: start {start}; {listed}. (mod {MODULUS})\nA:"
    solution, answer = worked_solution(start, ops)
    return ArithProblem(prompt, solution, answer, num_steps, start, ops)


def worked_solution(
    start: int, ops: tuple[tuple[str, int], ...], slip_rate: float = 0.0, rng: random.Random | None = None
) -> tuple[str, int]:
    """The chain of thought and its final value.

    `slip_rate` > 0 writes a wrong digit for a step's result with that probability, and the chain
    carries on from it: a careless but self-consistent worker. The warm start learns from such
    answers, so its sampling distribution is diffuse while its most likely digit is right.
    """
    value, steps = start, []
    for label, (sign, operand) in zip(_LABELS, ops):
        new = (value + operand if sign == "+" else value - operand) % MODULUS
        if slip_rate and rng is not None and rng.random() < slip_rate:
            new = (new + rng.randint(1, MODULUS - 1)) % MODULUS
        steps.append(f"{label}: {value}{sign}{operand}={new}")
        value = new
    return f" {start}; " + "; ".join(steps) + f". The answer is {value}.", value


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
