"""The calculator-call form of the built-in task's worked answer (tasks/arith_tools.py)."""

from __future__ import annotations

import random

from tokenizers import Tokenizer

from areal_jobs.tasks import arith_task
from areal_jobs.tasks.arith_tools import expression_of, segment_ids, tool_worked_solution
from areal_jobs.tasks.warm_start.tiny_model import PACKAGED_DIR


class Tok:
    def __init__(self) -> None:
        self.tok = Tokenizer.from_file(str(PACKAGED_DIR / "tokenizer.json"))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids


def test_without_calls_it_is_the_worked_solution() -> None:
    for i in range(50):
        p = arith_task.problem_at(3, i)
        segments, value = tool_worked_solution(p.start, p.ops, random.Random(i), tool_rate=0.0)
        assert (segments, value) == ([(p.solution, True)], p.answer)


def test_every_step_called() -> None:
    ops = (("+", 3), ("-", 2))
    segments, value = tool_worked_solution(8, ops, random.Random(0), tool_rate=1.0, misconception_rate=1.0)
    assert segments == [
        (" 8; a: 8+3=<calc>(8+3)%10</calc>", True),
        ("1", False),  # the right digit, not the misconception's 2
        ("; b: 1-2=<calc>(1-2)%10</calc>", True),
        ("9", False),
        (". The answer is 9.", True),
    ]
    assert value == 9


def test_at_most_max_calls() -> None:
    ops = (("+", 1),) * 5
    segments, value = tool_worked_solution(0, ops, random.Random(0), tool_rate=1.0, max_calls=2)
    assert [text for text, by_model in segments if not by_model] == ["1", "2"]
    assert segments[-1] == ("; c: 2+1=3; d: 3+1=4; e: 4+1=5. The answer is 5.", True) and value == 5


def test_written_steps_keep_the_misconception() -> None:
    segments, value = tool_worked_solution(
        8, (("+", 3),), random.Random(0), tool_rate=0.0, misconception_rate=1.0
    )
    assert (segments, value) == ([(" 8; a: 8+3=2. The answer is 2.", True)], 2)


def test_segments_tokenise_as_the_whole_text() -> None:
    """Each segment is tokenised on its own (as an episode builds them); its boundaries are
    pre-token boundaries, so the ids equal the whole text's: warm start and RL see the same ids."""
    tok, rng = Tok(), random.Random(5)
    for i in range(200):
        p = arith_task.problem_at(4, i)
        segments, _ = tool_worked_solution(p.start, p.ops, rng, 0.3, slip_rate=0.4, misconception_rate=0.7)
        ids, mask = segment_ids(tok, segments)
        assert ids == tok.encode("".join(text for text, _ in segments))
        assert len(mask) == len(ids) and sum(1 - m for m in mask) == sum(
            len(t) for t, by in segments if not by
        )


def test_expression_of() -> None:
    assert expression_of(" 8; a: 8+3=<calc>(8+3)%10</calc>") == "(8+3)%10"
    assert expression_of("a: <calc>1</calc>; b: 1+2=<calc> (1+2)%10 </calc>") == "(1+2)%10"
    assert expression_of("a: 8+3=</calc>") == ""
