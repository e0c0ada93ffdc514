"""The OpenAI-compatible endpoint over real HTTP on 127.0.0.1, driven by the real `openai` client,
in front of a fake EpisodeContext (fake_episode.py; the real one: tests/integration)."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from areal_jobs.agent.endpoint import AgentEndpoint

from .fake_episode import FakeEpisode, chat_format, chat_model_dir

QUESTION = "Q: start 7; a +3. (mod 10)\nA:"
PROMPT = "<|im_start|>user\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n"


def serve(model_dir, replies, test, max_turns=3, **data):
    """Run `test(client, episode, session, endpoint)` against a fresh endpoint and session."""
    chat, tok = chat_format(model_dir, **data)

    async def main():
        endpoint = AgentEndpoint("127.0.0.1", 0)
        await endpoint.start()
        prompt = tok.encode(PROMPT if chat.fmt.template_source else QUESTION)
        episode = FakeEpisode(tok, prompt, replies, end_token=chat.eos_token)  # the model's own end token
        session = endpoint.open(episode, chat, max_turns)
        client = openai.AsyncOpenAI(base_url=endpoint.base_url(session.sid), api_key="any", max_retries=0)
        try:
            await test(client, episode, session, endpoint)
        finally:
            await client.close()
            await endpoint.stop()
        return episode, tok

    return asyncio.run(main())


def test_two_chat_turns_extend_one_episode_token_exactly(tmp_path):
    async def test(client, episode, session, endpoint):
        messages = [{"role": "user", "content": QUESTION}]
        first = await client.chat.completions.create(model="m", messages=messages, max_tokens=64)
        assert first.choices[0].message.content == " 7; a: 7+3=0."
        assert first.choices[0].finish_reason == "stop"
        prompt_tokens = len(episode.prompt_ids)
        # 13 characters, one token each, and the end-of-turn token
        assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (prompt_tokens, 14)
        assert first.model == "m" and first.object == "chat.completion"
        messages += [{"role": "assistant", "content": first.choices[0].message.content}]
        messages += [{"role": "user", "content": "Say the answer."}]
        second = await client.chat.completions.create(model="m", messages=messages, max_tokens=64, stop=["."])
        assert second.choices[0].message.content == "The answer is 0."
        assert episode.generate_calls == [(64, None), (64, (".",))]
        assert [c.start for c in session.completions] == [prompt_tokens, second.usage.prompt_tokens]

    episode, tok = serve(chat_model_dir(tmp_path), [" 7; a: 7+3=0.", "The answer is 0."], test)
    first = [i for ch in " 7; a: 7+3=0." for i in tok.encode(ch)] + tok.encode("<|im_end|>")
    delta = tok.encode("\n<|im_start|>user\nSay the answer.<|im_end|>\n<|im_start|>assistant\n")
    second = [i for ch in "The answer is 0." for i in tok.encode(ch)] + tok.encode("<|im_end|>")
    # the model's first turn is kept as generated (not re-encoded: canonically it is shorter)
    assert len(tok.encode(" 7; a: 7+3=0.<|im_end|>")) < len(first)
    assert episode.output_ids == first + delta + second
    assert episode.loss_mask == [1] * len(first) + [0] * len(delta) + [1] * len(second)


def test_a_history_that_does_not_extend_the_episode_is_refused_and_changes_nothing(tmp_path):
    async def test(client, episode, session, endpoint):
        messages = [{"role": "user", "content": QUESTION}]
        first = await client.chat.completions.create(model="m", messages=messages)
        before = list(episode.token_ids)
        edited = messages + [
            {"role": "assistant", "content": first.choices[0].message.content + " (edited)"},
            {"role": "user", "content": "again"},
        ]
        with pytest.raises(openai.BadRequestError, match="does not extend this session's episode"):
            await client.chat.completions.create(model="m", messages=edited)
        with pytest.raises(openai.BadRequestError, match="does not extend"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "other"}])
        assert episode.token_ids == before and len(episode.generate_calls) == 1
        assert session.error is None  # the agent may correct itself
        good = messages + [dict(first.choices[0].message.to_dict()), {"role": "user", "content": "again"}]
        again = await client.chat.completions.create(model="m", messages=good)
        assert again.choices[0].message.content == "0"

    serve(chat_model_dir(tmp_path), [" 7; a: 7+3=0.", "0"], test)


def test_completions_take_the_episode_text_or_its_token_ids(tmp_path):
    async def test(client, episode, session, endpoint):
        first = await client.completions.create(model="m", prompt=QUESTION, max_tokens=32)
        # raw text, end token included: prompt + text is the episode so far
        assert first.choices[0].text == " 7; a: 7+3=0.<|endoftext|>"
        assert first.object == "text_completion"
        prompt = QUESTION + first.choices[0].text + "\nCheck:"
        second = await client.completions.create(model="m", prompt=prompt, max_tokens=3)
        assert second.choices[0].finish_reason == "length"
        assert second.choices[0].text == " ok"
        ids = list(episode.token_ids) + [5, 6]
        third = await client.completions.create(model="m", prompt=ids)
        assert third.usage.prompt_tokens == len(ids)
        with pytest.raises(openai.BadRequestError, match="do not start with this session's"):
            await client.completions.create(model="m", prompt=[1, 2, 3])

    model = chat_model_dir(tmp_path, template=None, eos="<|endoftext|>")
    episode, tok = serve(model, [" 7; a: 7+3=0.", " ok.", "x"], test, max_turns=4)
    assert episode.loss_mask[-4:] == [0, 0, 1, 1]  # the two appended ids, then "x" and its end token


def test_raw_chat_without_a_template_appends_the_new_message_after_the_end_token(tmp_path):
    async def test(client, episode, session, endpoint):
        messages = [{"role": "user", "content": QUESTION}]
        first = await client.chat.completions.create(model="m", messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}]
        await client.chat.completions.create(model="m", messages=messages + [{"role": "user", "content": "Again."}])

    model = chat_model_dir(tmp_path, template=None, eos="<|im_end|>")
    episode, tok = serve(model, ["7", "0"], test)
    assert tok.decode_raw(episode.output_ids) == "7<|im_end|>\nAgain.\n0<|im_end|>"


def test_reward_post_ends_the_episode(tmp_path):
    async def test(client, episode, session, endpoint):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}])
        reply = await client.post("/reward", cast_to=object, body={"reward": 0.5})
        assert reply == {"session": session.sid, "reward": 0.5, "num_turns": 1}
        assert session.reward == 0.5
        with pytest.raises(openai.BadRequestError, match="ended: its reward was posted"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}])
        with pytest.raises(openai.BadRequestError, match="ended"):
            await client.post("/reward", cast_to=object, body={"reward": 1.0})
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{endpoint.url}/sessions/{session.sid}") as response:
                summary = await response.json()
        assert summary["reward"] == 0.5 and summary["completions"][0]["version"] == 3

    serve(chat_model_dir(tmp_path), ["1"], test)


def test_unsupported_requests_are_refused_with_the_reason(tmp_path):
    async def test(client, episode, session, endpoint):
        user = [{"role": "user", "content": QUESTION}]
        cases = [
            ({"stream": True}, "non-streaming requests only"),
            ({"n": 2}, "n must be 1"),
            ({"max_tokens": 0}, "positive integer"),
            ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool definitions"),
        ]
        for extra, reason in cases:
            with pytest.raises(openai.BadRequestError, match=reason):
                await client.chat.completions.create(model="m", messages=user, **extra)
        with pytest.raises(openai.BadRequestError, match="reward' must be a finite number"):
            await client.post("/reward", cast_to=object, body={"reward": "high"})
        assert episode.generate_calls == []
        endpoint.close(session.sid)
        with pytest.raises(openai.NotFoundError, match="unknown session"):
            await client.chat.completions.create(model="m", messages=user)

    serve(chat_model_dir(tmp_path), [], test)


def test_turn_limit_and_one_request_at_a_time(tmp_path):
    async def test(client, episode, session, endpoint):
        user = [{"role": "user", "content": QUESTION}]
        gate = asyncio.Event()
        generate = episode.generate

        async def held(*args, **kwargs):
            await gate.wait()
            return await generate(*args, **kwargs)

        episode.generate = held
        running = asyncio.create_task(client.chat.completions.create(model="m", messages=user))
        while not session._busy:
            await asyncio.sleep(0)
        with pytest.raises(openai.BadRequestError, match="one request at a time"):
            await client.chat.completions.create(model="m", messages=user)
        gate.set()
        first = await running
        history = user + [{"role": "assistant", "content": first.choices[0].message.content}]
        with pytest.raises(openai.BadRequestError, match=r"1 model turns \(rollout.workflow.max_turns=1\)"):
            await client.chat.completions.create(model="m", messages=history + [{"role": "user", "content": "x"}])

    serve(chat_model_dir(tmp_path), ["1", "2"], test, max_turns=1)


def test_a_failed_generation_fails_the_session_for_its_workflow(tmp_path):
    async def test(client, episode, session, endpoint):
        episode.fail_with = RuntimeError("server gone")
        user = [{"role": "user", "content": QUESTION}]
        with pytest.raises(openai.InternalServerError, match="RuntimeError: server gone"):
            await client.chat.completions.create(model="m", messages=user)
        assert isinstance(session.error, RuntimeError)
        with pytest.raises(openai.BadRequestError, match="episode failed: server gone"):
            await client.chat.completions.create(model="m", messages=user)

    serve(chat_model_dir(tmp_path), [], test)
