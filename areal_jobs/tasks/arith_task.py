"""The built-in task: multi-step modular arithmetic with a worked chain of thought.

A problem names a start digit and k single-digit additions/subtractions, all modulo 10, each
step labelled by a letter. The worked answer takes the steps in order, so each step only needs
the previous result and the labelled operation. Example (k = 3):

    prompt:   "Q: start 7; a +3; b -9; c +2. (mod 10)\nA:"
    solution: " 7; a: 7+3=0; b: 0-9=1; c: 1+2=3. The answer is 3."

The warm start (tasks/warm_start/tiny_model.py) learns from answers with a systematic error, the
*misconception*: a step whose result is low on the dial (0, 1 or 2) is written one digit too high
(8+3=2, 3-1=3, 4-3=2). Its 18 facts are 30% of all steps, and its errors add up along a chain
instead of cancelling.

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


MISCONCEIVED_RESULTS = (0, 1, 2)


def is_misconception(value: int, sign: str, operand: int) -> bool:
    """A misconception fact: the step's right result is one of MISCONCEIVED_RESULTS."""
    return (value + operand if sign == "+" else value - operand) % MODULUS in MISCONCEIVED_RESULTS


def misconceived(value: int, sign: str, operand: int) -> int:
    """The misconception's result: one digit too high on a misconception fact (others are right)."""
    right = (value + operand if sign == "+" else value - operand) % MODULUS
    return right + 1 if is_misconception(value, sign, operand) else right


MISCONCEPTION_FACTS = tuple(
    (value, sign, operand)
    for value in range(MODULUS)
    for sign in "+-"
    for operand in range(1, MAX_OPERAND + 1)
    if is_misconception(value, sign, operand)
)


def worked_solution(
    start: int,
    ops: tuple[tuple[str, int], ...],
    slip_rate: float = 0.0,
    rng: random.Random | None = None,
    misconception_rate: float = 0.0,
) -> tuple[str, int]:
    """The chain of thought and its final value.

    `misconception_rate` > 0 writes the misconception's result for a misconception fact with that
    probability: above 0.5 the wrong digit is the most likely one for those 18 facts, so a policy
    that learns these answers is wrong *systematically* there (greedy decoding too).
    `slip_rate` > 0 writes a random wrong digit for a step's result with that probability: a
    careless worker, whose imitator samples diffusely. Either way the chain carries on from the
    digit written, so every answer stays self-consistent.
    """
    value, steps = start, []
    for label, (sign, operand) in zip(_LABELS, ops):
        new = (value + operand if sign == "+" else value - operand) % MODULUS
        misconceives = misconception_rate and rng is not None and is_misconception(value, sign, operand)
        if misconceives and rng.random() < misconception_rate:
            new = misconceived(value, sign, operand)
        if slip_rate and rng is not None and rng.random() < slip_rate:
            new = (new + rng.randint(1, MODULUS - 1)) % MODULUS
        steps.append(f"{label}: {value}{sign}{operand}={new}")
        value = new
    return f" {start}; " + "; ".join(steps) + f". The answer is {value}.", value


def eval_problem_at(seed: int, index: int) -> ArithProblem:
    return problem_at(seed + EVAL_SEED_OFFSET, index)


LENGTH_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, MAX_STEPS))  # chain lengths, for reports


def length_bucket(num_steps: int) -> str:
    """The report bucket of a chain length: "1", "2", "3-4", "5-8", "9-20"."""
    for low, high in LENGTH_BUCKETS:
        if low <= num_steps <= high:
            return str(low) if low == high else f"{low}-{high}"
    raise ValueError(f"num_steps={num_steps} is outside 1..{MAX_STEPS}")


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
