"""The countdown verifier: does the answer's expression use the given numbers and equal the target?

The reference is JSON {"numbers": [7, 6, 4], "target": 38}. The response must contain exactly one
"answer:" marker; the text after it (up to the end of its line, a trailing "." allowed) must be an
arithmetic expression over non-negative integer literals with the binary operators + - * and
parentheses, nothing else. It earns 1 when

    the multiset of its literals equals the multiset of the given numbers (each used exactly once)
    and its exact integer value equals the target.

Rules that close the usual loopholes (tests/unit/reward/test_reward_countdown.py tries each):
  - no eval(): a recursive-descent parser over a whitelist of tokens; anything else (names, "**",
    "/", "=", unary minus or plus, decimals, non-ASCII digits, leading zeros) is a parse error
  - every number exactly once: "38", "7*6-4+0", "7*6-4*1" and digit concatenation ("76") fail
  - one answer: a second "answer:" is a parse error (no shotgun of candidates)
  - bounded work: at most MAX_EXPRESSION_CHARS characters and MAX_DEPTH nested parentheses
Only the expression is scored; the reasoning before it is free text.
"""

from __future__ import annotations

import json
import re
from collections import Counter

from areal_jobs.api import RewardResult, RewardStatus

ANSWER_MARK = "answer:"
MAX_EXPRESSION_CHARS = 64
MAX_DEPTH = 8
_TOKEN = re.compile(r"\s*(?:(0|[1-9][0-9]{0,3})|([-+*()]))")


class ExpressionError(ValueError):
    """The text is not an expression of the allowed form (the message says why)."""


def tokenize(text: str) -> list[str]:
    """Integer literals and the operators + - * ( ); anything else is an ExpressionError."""
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ExpressionError(f"unexpected character at {pos}")
        tokens.append(match.group(1) or match.group(2))
        pos = match.end()
        if match.group(1) and pos < len(text) and text[pos].isdigit():
            raise ExpressionError("a number with a leading zero or more than four digits")
    if not tokens:
        raise ExpressionError("empty expression")
    return tokens


class _Parser:
    """expr := term (('+' | '-') term)*;  term := atom ('*' atom)*;  atom := INT | '(' expr ')'"""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.pos, self.literals = tokens, 0, []

    def parse(self) -> int:
        value = self.expr(0)
        if self.pos != len(self.tokens):
            raise ExpressionError(f"unexpected {self.tokens[self.pos]!r} after a complete expression")
        return value

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def expr(self, depth: int) -> int:
        value = self.term(depth)
        while self._peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self.term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self, depth: int) -> int:
        value = self.atom(depth)
        while self._peek() == "*":
            self.pos += 1
            value *= self.atom(depth)
        return value

    def atom(self, depth: int) -> int:
        token = self._peek()
        if token is None:
            raise ExpressionError("the expression ends early")
        self.pos += 1
        if token == "(":
            if depth >= MAX_DEPTH:
                raise ExpressionError(f"more than {MAX_DEPTH} nested parentheses")
            value = self.expr(depth + 1)
            if self._peek() != ")":
                raise ExpressionError("unbalanced parenthesis")
            self.pos += 1
            return value
        if token.isdigit():
            self.literals.append(int(token))
            return int(token)
        raise ExpressionError(f"{token!r} where a number or '(' belongs (no unary operators)")


def evaluate(expression: str) -> tuple[int, list[int]]:
    """(exact integer value, the literals in order) of an allowed expression; ExpressionError otherwise."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"longer than {MAX_EXPRESSION_CHARS} characters")
    parser = _Parser(tokenize(expression))
    return parser.parse(), parser.literals


def extract_expression(response: str) -> str:
    """The text after the only "answer:" marker, to the end of its line, one trailing "." dropped."""
    count = response.count(ANSWER_MARK)
    if count != 1:
        raise ExpressionError("no 'answer:'" if count == 0 else f"{count} 'answer:' markers (one allowed)")
    line = response.split(ANSWER_MARK, 1)[1].split("\n", 1)[0].strip()
    return line[:-1].rstrip() if line.endswith(".") else line


def parse_reference(reference: str) -> tuple[list[int], int]:
    ref = json.loads(reference)
    return [int(n) for n in ref["numbers"]], int(ref["target"])


def is_solution(expression: str, numbers: list[int], target: int) -> bool:
    """True when `expression` is allowed, uses `numbers` exactly (as a multiset) and equals `target`."""
    value, literals = evaluate(expression)
    return Counter(literals) == Counter(numbers) and value == target


def reward_countdown(response: str, reference: str) -> RewardResult:
    """1 when the answer's expression uses every given number once and equals the target, else 0."""
    numbers, target = parse_reference(reference)
    try:
        expression = extract_expression(response)
        value, literals = evaluate(expression)
    except ExpressionError as exc:
        return RewardResult(0.0, RewardStatus.parse_error, str(exc))
    if Counter(literals) != Counter(numbers):
        return RewardResult(0.0, detail="the expression does not use each given number exactly once")
    if value != target:
        return RewardResult(0.0, detail="the expression's value is not the target")
    return RewardResult(1.0)
