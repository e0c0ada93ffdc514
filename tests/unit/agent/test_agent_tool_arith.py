"""The tool_arith workflow on a scripted model: tool calls are answered by the real calculator,
the results are appended with loss mask 0, the call limit holds, and the reward is the task's.

The context here is a small stand-in with EpisodeContext's API (agent/context.py): a scripted
"model" that writes a fixed text, stopping after a stop string as a server does, and one token
per character, so masks can be checked character by character."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from areal_jobs.agent.tool_arith import tool_arith
from areal_jobs.agent.tools import calculator
from areal_jobs.data import arith_task


@dataclass
class Turn:
    token_ids: list[int]
    text: str
    finish_reason: str


@dataclass
class Config:
    max_tool_calls: int = 4


@dataclass
class Prompt:
    input_ids: list[int]
    reference: str


class ScriptedContext:
    """`script` is everything the model writes, tool results left out."""

    def __init__(self, prompt: str, answer: int, script: str, max_tool_calls: int = 4) -> None:
        self.prompt = Prompt(self.encode(prompt), str(answer))
        self.config = Config(max_tool_calls)
        self.script, self.pos = script, 0
        self.output: list[int] = []
        self.loss_mask: list[int] = []
        self.num_tool_calls = 0
        self.num_turns = 0
        self.stops: list[tuple[str, ...] | None] = []

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    @property
    def token_ids(self) -> list[int]:
        return self.prompt.input_ids + self.output

    async def generate(self, max_new_tokens=None, stop=None) -> Turn:
        self.num_turns += 1
        self.stops.append(stop)
        rest = self.script[self.pos :]
        cut = min((rest.find(s) + len(s) for s in stop or () if s in rest), default=len(rest))
        text = rest[:cut]
        self.pos += cut
        self.output += self.encode(text)
        self.loss_mask += [1] * len(text)
        return Turn(self.encode(text), text, "stop")  # ended by a stop string or end of sequence

    def append(self, ids: list[int]) -> None:
        self.output += ids
        self.loss_mask += [0] * len(ids)

    async def call_tool(self, name: str, arguments: str) -> str:
        assert name == "calculator"
        self.num_tool_calls += 1
        return calculator(arguments)

    async def score(self, text: str):
        return arith_task.reward(text, self.prompt.reference)

    def masked_text(self) -> str:
        """The episode with tool tokens shown as [..]."""
        out, inside = "", False
        for token, mask in zip(self.output, self.loss_mask):
            if not mask and not inside:
                out += "["
            if mask and inside:
                out += "]"
            inside = not mask
            out += chr(token)
        return out + ("]" if inside else "")


PROMPT = "Q: start 8; a +3; b -2. (mod 10)\nA:"


def test_a_call_is_answered_and_the_model_continues_from_the_result() -> None:
    # The warm start's misconception would write 8+3=2; the call gets the right digit, 1.
    ctx = ScriptedContext(PROMPT, 9, " 8; a: 8+3=<calc>(8+3)%10</calc>; b: 1-2=9. The answer is 9.")
    assert asyncio.run(tool_arith(ctx)) == 1.0
    assert ctx.masked_text() == " 8; a: 8+3=<calc>(8+3)%10</calc>[1]; b: 1-2=9. The answer is 9."
    assert (ctx.num_turns, ctx.num_tool_calls) == (2, 1)
    assert ctx.stops == [("</calc>",), ("</calc>",)]


def test_no_call_is_one_turn() -> None:
    ctx = ScriptedContext(PROMPT, 9, " 8; a: 8+3=2; b: 2-2=0. The answer is 0.")
    assert asyncio.run(tool_arith(ctx)) == 0.0  # the misconception, uncorrected
    assert (ctx.num_turns, ctx.num_tool_calls, sum(ctx.loss_mask) == len(ctx.output)) == (1, 0, True)


def test_calls_past_max_tool_calls_are_plain_text() -> None:
    script = " 8; a: 8+3=<calc>(8+3)%10</calc>; b: 1-2=<calc>(1-2)%10</calc>. The answer is 9."
    ctx = ScriptedContext(PROMPT, 9, script, max_tool_calls=1)
    assert asyncio.run(tool_arith(ctx)) == 1.0
    assert (
        ctx.masked_text()
        == " 8; a: 8+3=<calc>(8+3)%10</calc>[1]; b: 1-2=<calc>(1-2)%10</calc>. The answer is 9."
    )
    assert ctx.num_tool_calls == 1 and ctx.stops == [("</calc>",), None]


def test_a_malformed_call_gets_the_error_as_text() -> None:
    ctx = ScriptedContext(PROMPT, 9, " 8; a: 8+3=<calc>(8+)%10</calc>; b: 1-2=9. The answer is 9.")
    asyncio.run(tool_arith(ctx))
    assert "</calc>[error: not an arithmetic expression];" in ctx.masked_text()
    ctx = ScriptedContext(PROMPT, 9, " 8; a: 8+3=</calc>1. The answer is 1.")  # no opening tag
    assert asyncio.run(tool_arith(ctx)) == 0.0
    assert "=</calc>[error: not an arithmetic expression]1." in ctx.masked_text()
