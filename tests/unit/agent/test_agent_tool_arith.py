"""The tool_arith workflow through the real EpisodeContext and GenerationPath, over a scripted
server: calls are answered by the real calculator (agent/tools.py Toolbox), the results are
appended with loss mask 0, turns stop at "</calc>", the call limit holds, the reward is the
task's, and a resumed episode replays its calls without running a tool again.

Text is one token per character (token 0 ends the answer), so token ids and masks can be read
character by character."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from areal_jobs.agent.context import EpisodeContext, EpisodeServices, EpisodeText, run_episode
from areal_jobs.agent.episode import EpisodeState
from areal_jobs.agent.tool_arith import tool_arith
from areal_jobs.agent.tools import Toolbox
from areal_jobs.api import FinishReason
from areal_jobs.config import AlgoConfig, RolloutConfig, WorkflowConfig
from areal_jobs.data.prompts import Prompt
from areal_jobs.rollout.controller import RolloutController
from areal_jobs.rollout.evaluation import evaluate_problems
from areal_jobs.rollout.generation import GenerationPath, Sampling
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.tasks import arith_task

from .scripted import Scripted, answer

PROMPT_TEXT = "Q: start 8; a +3; b -2. (mod 10)\nA:"
EOS = 0


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(t) for t in ids if t != EOS)


def turn(text: str, end: bool = False):
    """A server answer: `text`, plus the end-of-sequence token when the answer ends there."""
    return answer(encode(text) + ([EOS] if end else []))


class NoScorer:
    async def score_group(self, requests):
        raise AssertionError("tool_arith calls only the calculator, which runs in-process")


class Episode:
    """One tool_arith episode of PROMPT_TEXT (answer 9) over `server`."""

    def __init__(self, server, max_tool_calls: int = 4) -> None:
        pool = ServerPool()
        pool.add(0, server)
        running = asyncio.Event()
        running.set()
        path = GenerationPath(pool, running, lambda: 0)
        sampling = Sampling(64, temperature=1.0)
        self.config = WorkflowConfig(name="tool_arith", max_tool_calls=max_tool_calls, max_episode_tokens=400)
        self.tool_calls: list[tuple[str, str]] = []
        toolbox = Toolbox(NoScorer(), timeout_s=1.0, output_chars=64)

        async def generate(rid, prompt_ids, state, max_new, stop):
            return await path.run(
                rid, prompt_ids, state, replace(sampling, max_new_tokens=max_new, stop=stop or ())
            )

        async def call_tool(name, arguments):
            self.tool_calls.append((name, arguments))
            return await toolbox.call(name, arguments)

        async def score(request):
            return arith_task.reward(request.response, request.reference)

        text = EpisodeText(encode, decode, decode, lambda role, content: ("", content))
        self.services = EpisodeServices(generate, lambda: 0, text, score, 64, call_tool)
        self.prompt = Prompt(0, encode(PROMPT_TEXT), "arith", "9")
        self.server = server

    def run(self, state: EpisodeState) -> EpisodeState:
        asyncio.run(
            run_episode(tool_arith, EpisodeContext(self.prompt, self.config, state, self.services, "r"))
        )
        return state


def masked(state: EpisodeState) -> str:
    """The episode's text with the tool's tokens (loss mask 0) shown in brackets."""
    out = ""
    for token, mask, prev in zip(state.output_ids, state.loss_mask, [1, *state.loss_mask]):
        out += ("[" if prev and not mask else "]" if mask and not prev else "") + decode([token])
    return out + ("]" if state.loss_mask and not state.loss_mask[-1] else "")


def test_a_call_is_answered_and_the_model_continues_from_the_result() -> None:
    # The warm start's misconception would write 8+3=2; the call gets the right digit, 1.
    server = Scripted(
        [turn(" 8; a: 8+3=<calc>(8+3)%10</calc>"), turn("; b: 1-2=9. The answer is 9.", end=True)]
    )
    episode = Episode(server)
    state = episode.run(EpisodeState("g/0"))
    assert masked(state) == " 8; a: 8+3=<calc>(8+3)%10</calc>[1]; b: 1-2=9. The answer is 9."
    assert (state.reward, state.reward_status, state.num_turns, state.num_tool_calls) == (1.0, "ok", 2, 1)
    assert episode.tool_calls == [("calculator", "(8+3)%10")]
    assert state.logprobs[state.loss_mask.index(0)] == 0.0  # the tool's token was not sampled
    # each turn stops after a call, and the second one is sent with the tool's result
    assert [r.stop for r in server.requests] == [("</calc>",), ("</calc>",)]
    assert server.requests[1].input_ids == encode(PROMPT_TEXT + " 8; a: 8+3=<calc>(8+3)%10</calc>1")


def test_no_call_is_one_turn() -> None:
    server = Scripted([turn(" 8; a: 8+3=2; b: 2-2=0. The answer is 0.", end=True)])
    state = Episode(server).run(EpisodeState("g/0"))
    assert state.reward == 0.0  # the misconception, uncorrected
    assert (state.num_turns, state.num_tool_calls, set(state.loss_mask)) == (1, 0, {1})


def test_calls_past_max_tool_calls_are_plain_text() -> None:
    server = Scripted(
        [
            turn(" 8; a: 8+3=<calc>(8+3)%10</calc>"),
            turn("; b: 1-2=<calc>(1-2)%10</calc>9. The answer is 9.", end=True),
        ]
    )
    state = Episode(server, max_tool_calls=1).run(EpisodeState("g/0"))
    assert (
        masked(state)
        == " 8; a: 8+3=<calc>(8+3)%10</calc>[1]; b: 1-2=<calc>(1-2)%10</calc>9. The answer is 9."
    )
    assert state.num_tool_calls == 1 and state.reward == 1.0
    assert [r.stop for r in server.requests] == [("</calc>",), ()]  # the last turn does not stop at a call


def test_a_malformed_call_gets_the_error_as_text() -> None:
    server = Scripted([turn(" 8; a: 8+3=<calc>(8+)%10</calc>"), turn("2. The answer is 2.", end=True)])
    state = Episode(server).run(EpisodeState("g/0"))
    assert "</calc>[error: not an arithmetic expression]2." in masked(state)
    assert state.reward == 0.0


def test_a_resumed_episode_replays_its_call_without_running_the_tool_again() -> None:
    first = Scripted(
        [turn(" 8; a: 8+3=<calc>(8+3)%10</calc>"), turn("; b: 1-2=9. The answer is 9.", end=True)]
    )
    done = Episode(first).run(EpisodeState("g/0"))
    again = Episode(Scripted([]))  # no server answer and no tool run may be needed
    replayed = again.run(EpisodeState(**{k: getattr(done, k) for k in done.__dataclass_fields__}))
    assert (replayed.reward, replayed.output_ids) == (1.0, done.output_ids)
    assert again.tool_calls == [] and again.server.requests == []


def test_an_episode_out_of_tokens_ends_without_a_call() -> None:
    server = Scripted([answer(encode(" 8; a: 8+3=<calc>(8+3"), finish=FinishReason.length)])
    state = Episode(server).run(EpisodeState("g/0"))
    assert (state.num_tool_calls, state.reward_status) == (0, "parse_error")


class ArithScorer:
    async def score_group(self, requests):
        return [arith_task.reward(r.response, r.reference) for r in requests]

    def metrics(self):
        return {}


def controller(server, workflow: str) -> RolloutController:
    pool = ServerPool()
    pool.add(0, server)
    rollout = RolloutConfig(max_new_tokens=64, workflow=WorkflowConfig(name=workflow, max_episode_tokens=400))
    text = EpisodeText(encode, decode, decode, lambda role, content: ("", content))
    return RolloutController(
        rollout, AlgoConfig(batch_size=1, group_size=2), pool, ArithScorer(), stream=None, decode=decode,
        push=None, text=text, call_tool=Toolbox(NoScorer(), 1.0, 64).call,
    )  # fmt: skip


def test_evaluation_runs_the_workflow_with_its_tools() -> None:
    """Held-out accuracy of a tool workflow is measured with its tools (greedy here)."""
    server = Scripted(
        [turn(" 8; a: 8+3=<calc>(8+3)%10</calc>"), turn("; b: 1-2=9. The answer is 9.", end=True)]
    )
    ctl = controller(server, "tool_arith")
    path = GenerationPath(ctl.pool, ctl.running, lambda: ctl.version)
    prompt = Prompt(0, encode(PROMPT_TEXT), "arith", "9")
    outcome = asyncio.run(
        evaluate_problems(
            path,
            NoScorer(),
            [prompt],
            decode,
            sampling=Sampling(64, temperature=0.0),
            tag="t",
            episode=ctl.eval_episodes(path),
        )  # fmt: skip
    )
    assert outcome.summary.accuracy == 1.0
    assert outcome.problems[0].texts == [" 8; a: 8+3=<calc>(8+3)%10</calc>1; b: 1-2=9. The answer is 9."]
    assert [(r.stop, r.temperature) for r in server.requests] == [(("</calc>",), 0.0)] * 2
    assert controller(Scripted([]), "single_turn").eval_episodes(path) is None  # one turn, batch-scored
