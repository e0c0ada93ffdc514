"""The second built-in task: countdown (make the target from three numbers with + - *).

A problem gives three digits and a target; an answer is an expression that uses each digit exactly
once and equals the target (reward/countdown.py verifies it). Every problem has at least
MIN_SOLUTIONS distinct solutions (commutative variants counted once), so a prompt has several
right answers, and the target is drawn uniformly among the values that many expressions reach:
no fixed template of positions and operators solves more than a small share of the problems
(tests/unit/tasks/test_tasks_countdown_task.py measures the best one).

The worked answer a warm start imitates: a scratchpad of every pair's sum and product (with the
number left over), then attempts, each an expression and its value, until one hits the target
(at most MAX_TRIES), then the answer. Example:

    prompt:   "Q: make 38 from 7 6 4\nA:"
    solution: " 7+6=13 7*6=42 (4); 7+4=11 7*4=28 (6); 6+4=10 6*4=24 (7). try (7+6)-4: 13-4=9 no;
               try (7*6)-4: 42-4=38 yes. answer: (7*6)-4"      (one line)

The scratchpad is deterministic arithmetic; the choices are the attempts, and which to try first
is what RL can learn. Answers are 60-130 tokens with the built-in tokenizer. Problems are a pure
function of (seed, index).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import cache

NUM_NUMBERS = 3
MIN_NUMBER, MAX_NUMBER = 2, 9  # no 1: x*1 = x would make trivially different answers
MIN_TARGET, MAX_TARGET = 10, 99
MIN_SOLUTIONS = 2
EVAL_SEED_OFFSET = 2_000_003  # held-out problems: a seed stream disjoint from training (and arith's)
# (pair op) and how the leftover number joins it: "(x op y) op2 z" or "z op2 (x op y)"
PAIR_OPS = ("+", "*", "-")
JOIN_FORMS = ("r+z", "r-z", "z-r", "r*z")


@dataclass(frozen=True)
class Attempt:
    """One candidate: the pair (x, y) combined by `op` (x - y with x >= y), then joined with z."""

    x: int
    y: int
    op: str
    z: int
    form: str  # one of JOIN_FORMS

    @property
    def pair_value(self) -> int:
        return _apply(self.x, self.op, self.y)

    @property
    def value(self) -> int:
        r, z = self.pair_value, self.z
        return {"r+z": r + z, "r-z": r - z, "z-r": z - r, "r*z": r * z}[self.form]

    @property
    def expression(self) -> str:
        pair = f"({self.x}{self.op}{self.y})"
        return {
            "r+z": f"{pair}+{self.z}",
            "r-z": f"{pair}-{self.z}",
            "z-r": f"{self.z}-{pair}",
            "r*z": f"{pair}*{self.z}",
        }[self.form]

    @property
    def step(self) -> str:
        """The attempt's arithmetic on the pair's value: "42-4=38"."""
        r, z = self.pair_value, self.z
        lhs = {"r+z": f"{r}+{z}", "r-z": f"{r}-{z}", "z-r": f"{z}-{r}", "r*z": f"{r}*{z}"}[self.form]
        return f"{lhs}={self.value}"

    def canonical(self) -> frozenset:
        """The expression as a polynomial in its numbers (a number's symbol is its value), so
        that rearrangements of one answer compare equal: (7+6)+4, (7+4)+6 and 4+(6+7) are one
        answer, (7*6)-4 and (6*7)-4 another."""
        pair = _poly_op(_symbol(self.x), self.op, _symbol(self.y))
        z = _symbol(self.z)
        joined = {
            "r+z": _poly_op(pair, "+", z),
            "r-z": _poly_op(pair, "-", z),
            "z-r": _poly_op(z, "-", pair),
            "r*z": _poly_op(pair, "*", z),
        }[self.form]
        return frozenset(joined.items())


Poly = dict[tuple[int, ...], int]  # monomial (sorted numbers multiplied) -> integer coefficient


def _symbol(n: int) -> Poly:
    return {(n,): 1}


def _poly_op(a: Poly, op: str, b: Poly) -> Poly:
    out: Poly = dict(a)
    if op == "*":
        out = {}
        for ma, ca in a.items():
            for mb, cb in b.items():
                mono = tuple(sorted(ma + mb))
                out[mono] = out.get(mono, 0) + ca * cb
    else:
        sign = 1 if op == "+" else -1
        for mb, cb in b.items():
            out[mb] = out.get(mb, 0) + sign * cb
    return {m: c for m, c in out.items() if c}


def _apply(x: int, op: str, y: int) -> int:
    return x + y if op == "+" else x * y if op == "*" else x - y


def pairs(numbers: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first, second, leftover) for each pair of positions, in prompt order."""
    a, b, c = numbers
    return [(a, b, c), (a, c, b), (b, c, a)]


@cache
def attempts(numbers: tuple[int, ...]) -> tuple[Attempt, ...]:
    """Every candidate whose intermediate and final values lie in [0, 99] (the search space of
    the worked answers), one per canonical form."""
    seen, out = set(), []
    for first, second, z in pairs(numbers):
        for op in PAIR_OPS:
            x, y = (max(first, second), min(first, second)) if op == "-" else (first, second)
            for form in JOIN_FORMS:
                att = Attempt(x, y, op, z, form)
                if not (0 <= att.pair_value <= MAX_TARGET and 0 <= att.value <= MAX_TARGET):
                    continue
                if att.canonical() not in seen:
                    seen.add(att.canonical())
                    out.append(att)
    return tuple(out)


def solutions(numbers: tuple[int, ...], target: int) -> list[Attempt]:
    return [a for a in attempts(numbers) if a.value == target]


@dataclass(frozen=True)
class CountdownProblem:
    numbers: tuple[int, ...]
    target: int
    prompt: str
    reference: str  # JSON for reward/countdown.py

    @property
    def solutions(self) -> list[Attempt]:
        return solutions(self.numbers, self.target)


def problem_at(seed: int, index: int) -> CountdownProblem:
    """The `index`-th problem of stream `seed`: digits 1-9, a target in [10, 99] that at least
    MIN_SOLUTIONS distinct expressions reach, drawn uniformly among such values."""
    rng = random.Random(seed * 1_000_000_007 + index + 17)
    while True:  # bounded in practice: most digit triples have such targets (a test counts the tries)
        numbers = tuple(rng.randint(MIN_NUMBER, MAX_NUMBER) for _ in range(NUM_NUMBERS))
        counts: dict[int, int] = {}
        for att in attempts(numbers):
            if MIN_TARGET <= att.value <= MAX_TARGET:
                counts[att.value] = counts.get(att.value, 0) + 1
        targets = sorted(v for v, n in counts.items() if n >= MIN_SOLUTIONS)
        if targets:
            target = rng.choice(targets)
            break
    listed = " ".join(map(str, numbers))
    reference = json.dumps({"numbers": list(numbers), "target": target})
    return CountdownProblem(numbers, target, f"Q: make {target} from {listed}\nA:", reference)


def eval_problem_at(seed: int, index: int) -> CountdownProblem:
    return problem_at(seed + EVAL_SEED_OFFSET, index)


def scratchpad(numbers: tuple[int, ...]) -> str:
    """Every pair's sum and product, then the number the pair leaves over: " 7+6=13 7*6=42 (4);"."""
    parts = [f"{x}+{y}={x + y} {x}*{y}={x * y} ({z})" for x, y, z in pairs(numbers)]
    return " " + "; ".join(parts) + "."


def guided_solution(problem: CountdownProblem, rng: random.Random, max_misses: int = 3) -> str:
    """Phase 1's worked answer (tasks/warm_start/countdown_model.py): the scratchpad, 0..max_misses wrong
    attempts (distinct, uniformly chosen), one right attempt (uniform among the solutions), the
    answer. It teaches the format and the arithmetic; its worker knows where the answer is, which
    no policy can imitate (a model trained on it alone says "yes" to wrong values at the 4th try)."""
    candidates = list(attempts(problem.numbers))
    hits = [a for a in candidates if a.value == problem.target]
    wrong = [a for a in candidates if a.value != problem.target]
    misses = rng.sample(wrong, min(rng.randint(0, max_misses), len(wrong)))
    final = rng.choice(hits)
    tries = [f" try {a.expression}: {a.step} no;" for a in misses]
    tries.append(f" try {final.expression}: {final.step} yes.")
    return scratchpad(problem.numbers) + "".join(tries) + f" answer: {final.expression}"


# Phase 2's worker, the one the warm start ends up imitating: it tries the candidates in a random
# order, checks each value against the target, and stops at the first hit or after MAX_TRIES
# tries ("answer: none", which earns 0). A policy can imitate it exactly, so the warm start's
# sampled accuracy is about the chance that one of MAX_TRIES random candidates hits (0.48 over the
# held-out problems, less its slips); RL has the rest to learn: which pairs and joins to try first
# (the scratchpad lists every pair's value next to the number it leaves over).
MAX_TRIES = 4
NO_ANSWER = "none"


def search_solution(problem: CountdownProblem, rng: random.Random, max_tries: int = MAX_TRIES) -> str:
    order = rng.sample(list(attempts(problem.numbers)), len(attempts(problem.numbers)))[:max_tries]
    tries, final = [], NO_ANSWER
    for att in order:
        if att.value == problem.target:
            tries.append(f" try {att.expression}: {att.step} yes.")
            final = att.expression
            break
        tries.append(f" try {att.expression}: {att.step} no;")
    return scratchpad(problem.numbers) + "".join(tries) + f" answer: {final}"
