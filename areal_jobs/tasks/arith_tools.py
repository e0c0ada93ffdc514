"""The tool-use form of the built-in task's worked answer: the calculator call format shared by the
`tool_arith` workflow (agent/tool_arith.py) and the warm start that teaches it
(data/tool_warm_start.py).

A step may hand its result to the calculator instead of writing the digit. The model writes the
step up to "=", then a call, and stops at CALL_CLOSE; the environment appends the calculator's
result (loss mask 0) and the model goes on from it:

    model:  " 8; a: 8+3=<calc>(8+3)%10</calc>"       (generation stops at "</calc>")
    tool:   "1"                                       (calculator("(8+3)%10"), appended)
    model:  "; b: 1-2=9. The answer is 9."

The call comes after "=", where the model has the whole fact in view and is about to write the
result digit: the place where it would write a misconception's wrong digit (8+3=2) is the place
where it may call instead, so RL can learn to call exactly where its own answer is unreliable.
The tool's result is the right digit, and the chain continues from it, as from any written digit.
"""

from __future__ import annotations

import random
import string

from areal_jobs.tasks import arith_task

CALL_OPEN = "<calc>"
CALL_CLOSE = "</calc>"  # the stop string of a tool turn
TOOL_NAME = "calculator"  # agent/tools.py


def call_expression(value: int, sign: str, operand: int) -> str:
    """The expression of one step's call: "(8+3)%10" (the calculator returns "1")."""
    return f"({value}{sign}{operand})%{arith_task.MODULUS}"


def expression_of(turn_text: str) -> str:
    """The expression of the call that ends `turn_text` (which ends with CALL_CLOSE); "" when the
    turn holds no CALL_OPEN (the calculator then answers with an error the model reads)."""
    body = turn_text.rstrip()
    if body.endswith(CALL_CLOSE):
        body = body[: -len(CALL_CLOSE)]
    start = body.rfind(CALL_OPEN)
    return body[start + len(CALL_OPEN) :].strip() if start >= 0 else ""


Segment = tuple[str, bool]  # (text, written by the model); False: a tool's result (loss mask 0)


def tool_worked_solution(
    start: int,
    ops: tuple[tuple[str, int], ...],
    rng: random.Random,
    tool_rate: float,
    slip_rate: float = 0.0,
    misconception_rate: float = 0.0,
    max_calls: int = arith_task.MAX_STEPS,
) -> tuple[list[Segment], int]:
    """The worked answer of arith_task.worked_solution, in segments, where each step calls the
    calculator with probability `tool_rate`. A called step's result is right (the tool's); a
    written one carries the misconception and slips at the given rates, as in worked_solution.
    At most `max_calls` steps call (the workflow's rollout.workflow.max_tool_calls: longer chains
    would not fit the tiny model's 512 positions). Returns the segments (model text and tool
    results, alternating) and the final value."""
    segments: list[Segment] = []
    text, value = f" {start}; ", start
    for i, (label, (sign, operand)) in enumerate(zip(string.ascii_lowercase, ops)):
        text += f"{'; ' if i else ''}{label}: {value}{sign}{operand}="
        right = (value + operand if sign == "+" else value - operand) % arith_task.MODULUS
        if rng.random() < tool_rate and len(segments) < 2 * max_calls:
            segments += [(text + CALL_OPEN + call_expression(value, sign, operand) + CALL_CLOSE, True)]
            segments += [(str(right), False)]
            text, value = "", right
            continue
        new = right
        if misconception_rate and arith_task.is_misconception(value, sign, operand):
            if rng.random() < misconception_rate:
                new = arith_task.misconceived(value, sign, operand)
        if slip_rate and rng.random() < slip_rate:
            new = (new + rng.randint(1, arith_task.MODULUS - 1)) % arith_task.MODULUS
        text, value = text + str(new), new
    segments.append((text + f". The answer is {value}.", True))
    return segments, value


def segment_ids(tokenizer, segments: list[Segment]) -> tuple[list[int], list[int]]:
    """Token ids of the segments, each tokenised on its own as an episode builds them (the model's
    turns by the server, a tool result by ctx.encode), and their loss mask (1: model text)."""
    ids: list[int] = []
    mask: list[int] = []
    for text, by_model in segments:
        if text:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            mask += [int(by_model)] * len(piece)
    return ids, mask
