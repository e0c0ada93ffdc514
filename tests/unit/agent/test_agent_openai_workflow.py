"""The openai_agent workflow over the real EpisodeContext, with a scripted model behind it: the
example agent (examples/arith_agent.py) and small agents run as episodes through the endpoint,
over real HTTP with the real `openai` client."""

from __future__ import annotations

import asyncio
import copy
import threading

import openai
import pytest

from areal_jobs.agent import openai_agent as workflow
from areal_jobs.agent.agent_loop import AgentLoop
from areal_jobs.agent.context import EpisodeContext, EpisodeServices, EpisodeText, run_episode
from areal_jobs.agent.episode import EpisodeState
from areal_jobs.api import RewardResult
from areal_jobs.config import WorkflowConfig
from areal_jobs.data.prompts import Prompt
from examples.arith_agent import ASK_AGAIN

from .fake_episode import chat_model_dir, prompt_format

QUESTION = "Q: start 7; a +3. (mod 10)\nA:"
EXAMPLE = "examples.arith_agent:agent"


class Model:
    """Scripted turns, one token per character plus the end token; log-prob -0.5, version 7."""

    def __init__(self, tok, end_token, replies):
        self.tok, self.end_id, self.replies = tok, tok._tok.token_to_id(end_token), list(replies)
        self.requests = []
        self.fail_with = None

    async def generate(self, rid, prompt_ids, state, max_new_tokens, stop):
        self.requests.append((rid, prompt_ids + state.output_ids, max_new_tokens, stop))
        if self.fail_with is not None:
            raise self.fail_with
        ids = [i for ch in self.replies.pop(0) for i in self.tok.encode(ch)] + [self.end_id]
        state.open_turn()
        state.add_model_tokens(ids[:max_new_tokens], [-0.5] * len(ids[:max_new_tokens]), 7)
        return state.close_turn("stop" if len(ids) <= max_new_tokens else "length")


def episode(tmp_path, replies, agent=EXAMPLE, template=True, max_turns=3):
    """(context factory, model, scored texts): a fresh context on a state, as the controller builds it."""
    model_dir = (
        chat_model_dir(tmp_path, eos="<|im_end|>")
        if template
        else chat_model_dir(tmp_path, None, "<|endoftext|>")
    )
    fmt, tok = prompt_format(model_dir)
    model, scored = Model(tok, fmt.specials["eos_token"], replies), []

    async def score(request):
        scored.append(request.response)
        return RewardResult(1.0 if request.response.endswith("The answer is 0.") else 0.0)

    text = EpisodeText(tok.encode, tok.decode, tok.decode_raw, fmt.message_texts)
    services = EpisodeServices(model.generate, lambda: 7, text, score, max_new_tokens=32)
    prompt = Prompt(0, tok.encode(fmt.render(QUESTION)), "arith", "0")
    # the re-ask alone is 81 tokens of the byte-level tokenizer: room for it and the turns
    config = WorkflowConfig(name="openai_agent", agent=agent, max_turns=max_turns, max_episode_tokens=1000)

    def context(state):
        return EpisodeContext(prompt, config, state, services, "r")

    return context, model, scored, tok


def run(context, state):
    async def main():
        try:
            await run_episode(workflow.openai_agent, context(state))
        finally:
            await workflow.stop_shared_services()

    asyncio.run(main())
    return state


def test_the_example_agent_asks_again_after_a_malformed_answer(tmp_path):
    context, model, scored, tok = episode(tmp_path, ["7", "The answer is 0."])
    state = run(context, EpisodeState("g0/0"))
    re_ask = tok.encode(f"\n<|im_start|>user\n{ASK_AGAIN}<|im_end|>\n<|im_start|>assistant\n")
    first = [i for ch in "7" for i in tok.encode(ch)] + tok.encode("<|im_end|>")
    assert state.output_ids[: len(first) + len(re_ask)] == first + re_ask  # "<|im_end|>" not repeated
    assert state.loss_mask == [1] * 2 + [0] * len(re_ask) + [1] * 17
    assert (state.reward, state.reward_status, state.num_turns) == (1.0, "ok", 2)
    assert scored == ["The answer is 0."]  # the last completion's text, scored by the task
    # the first request was the prompt itself: the agent's messages were the prompt's
    assert model.requests[0][1] == context(EpisodeState("x")).prompt.input_ids


def test_without_a_chat_template_the_agent_gets_the_prompt_text_as_its_message(tmp_path):
    context, model, scored, tok = episode(tmp_path, [" 7; a: 7+3=0. The answer is 0."], template=False)
    state = run(context, EpisodeState("g0/0"))
    assert (state.reward, state.num_turns, sum(state.loss_mask)) == (1.0, 1, len(state.output_ids))


@pytest.mark.parametrize(
    ("returns", "posts", "expected"),
    [(0.25, None, 0.25), (None, 0.75, 0.75), (0.25, 0.75, 0.25), (None, None, 0.0)],
)
def test_reward_is_the_returned_then_the_posted_then_the_tasks(
    tmp_path, monkeypatch, returns, posts, expected
):
    async def agent(base_url, messages):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)
        await client.chat.completions.create(model="m", messages=messages)
        if posts is not None:
            await client.post("/reward", cast_to=object, body={"reward": posts})
        await client.close()
        return returns

    monkeypatch.setattr(workflow, "resolve_agent", lambda target: agent)
    context, model, scored, tok = episode(tmp_path, ["The answer is 3."])
    assert run(context, EpisodeState("g0/0")).reward == expected
    assert scored == (["The answer is 3."] if (returns, posts) == (None, None) else [])


def test_a_sync_agent_runs_in_a_thread_with_the_sync_client(tmp_path, monkeypatch):
    def agent(base_url, messages, prompt_text, reference):
        with openai.OpenAI(base_url=base_url, api_key="-", max_retries=0) as client:
            reply = client.chat.completions.create(model="m", messages=messages)
        return float(reply.choices[0].message.content == reference) + 0.5 * prompt_text.endswith("A:")

    monkeypatch.setattr(workflow, "resolve_agent", lambda target: agent)
    context, model, scored, tok = episode(tmp_path, ["0"], template=False)
    assert run(context, EpisodeState("g0/0")).reward == 1.5


def test_a_failing_or_idle_agent_ends_only_its_episode(tmp_path, monkeypatch):
    async def refused(base_url, messages):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "not the prompt"}]
        )

    async def idle(base_url):
        return 1.0

    for agent in (refused, idle):
        monkeypatch.setattr(workflow, "resolve_agent", lambda target, agent=agent: agent)
        folder = tmp_path / agent.__name__
        folder.mkdir()
        context, model, scored, tok = episode(folder, [])
        state = run(context, EpisodeState("g0/0"))
        assert (state.reward, state.reward_status) == (0.0, "error") and model.requests == []


def test_a_generation_failure_ends_the_run_even_when_the_agent_swallowed_it(tmp_path, monkeypatch):
    async def swallowing(base_url, messages):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)
        try:
            await client.chat.completions.create(model="m", messages=messages)
        except openai.InternalServerError:
            return 1.0

    monkeypatch.setattr(workflow, "resolve_agent", lambda target: swallowing)
    context, model, scored, tok = episode(tmp_path, [])
    model.fail_with = RuntimeError("server gone")
    with pytest.raises(RuntimeError, match="server gone"):
        run(context, EpisodeState("g0/0"))


def test_a_resumed_episode_replays_the_agents_turns_without_generating(tmp_path):
    context, model, scored, tok = episode(tmp_path, ["7", "The answer is 0."])
    done = run(context, EpisodeState("g0/0"))
    restored = copy.deepcopy(done)
    restored.reward, restored.reward_status = 0.0, ""  # as a checkpoint taken before the reward
    model.fail_with = AssertionError("a replayed turn was generated again")
    again = run(context, restored)
    assert (again.output_ids, again.loss_mask, again.reward) == (done.output_ids, done.loss_mask, 1.0)


def test_the_agent_target_is_checked_and_called_with_what_it_declares():
    with pytest.raises(
        ValueError, match="rollout.workflow.agent='': set it to your agent's 'module:function'"
    ):
        workflow.resolve_agent("")
    with pytest.raises(ValueError, match="cannot be loaded"):
        workflow.resolve_agent("examples.no_such_agent:agent")
    assert workflow.resolve_agent(EXAMPLE).__name__ == "agent"

    def two(base_url, messages):
        return (base_url, messages)

    def any_(**kwargs):
        return sorted(kwargs)

    arguments = {"base_url": "u", "messages": [], "prompt_text": "p", "reference": "r"}
    assert workflow.declared(two, arguments) == {"base_url": "u", "messages": []}
    assert workflow.declared(any_, arguments) == arguments


def test_agents_run_on_their_own_loop_so_a_blocking_agent_cannot_stall_the_controller():
    released = threading.Event()

    async def blocking(**kwargs):  # a sync wait inside async def: would freeze the caller's loop
        return released.wait(timeout=60), threading.current_thread().name

    def plain(x):
        return x + 1

    async def main():
        agents = AgentLoop()
        try:
            call = asyncio.create_task(agents.call(blocking, {}))
            await asyncio.sleep(0)  # the controller's loop runs on while the agent blocks
            released.set()
            assert await call == (True, "areal-agents")
            assert await agents.call(plain, {"x": 1}) == 2
            started, cancelled = threading.Event(), []

            async def forever():
                started.set()
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    cancelled.append(True)
                    raise

            waiting = asyncio.create_task(agents.call(forever, {}))
            await asyncio.to_thread(started.wait, 60)
            waiting.cancel()  # the controller stops: the agent is cancelled on its loop
            with pytest.raises(asyncio.CancelledError):
                await waiting
        finally:
            await agents.stop()
        return cancelled

    assert asyncio.run(main()) == [True]
