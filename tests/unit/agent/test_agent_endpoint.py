"""The OpenAI-compatible endpoint over real HTTP on 127.0.0.1, driven by the real `openai` client,
in front of a fake EpisodeContext (fake_episode.py; the real one: tests/integration)."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from areal_jobs.agent.endpoint import AgentEndpoint

from .fake_episode import FakeEpisode, chat_model_dir, prompt_format

QUESTION = "Q: start 7; a +3. (mod 10)\nA:"
PROMPT = "<|im_start|>user\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n"
USER = [{"role": "user", "content": QUESTION}]


def serve(model_dir, replies, test, max_turns=3, **data):
    """Run `test(client, episode, session, endpoint)` against a fresh endpoint and session."""
    fmt, tok = prompt_format(model_dir, **data)
    chat = fmt.template_source is not None

    async def main():
        endpoint = AgentEndpoint("127.0.0.1", 0)
        await endpoint.start()
        prompt = tok.encode(PROMPT if chat else QUESTION)
        episode = FakeEpisode(tok, chat, prompt, replies, end_token=fmt.specials["eos_token"])
        session = endpoint.open(episode, tok.decode_raw, USER, max_turns)
        client = openai.AsyncOpenAI(base_url=endpoint.base_url(session.sid), api_key="any", max_retries=0)
        try:
            await test(client, episode, session, endpoint)
        finally:
            await client.close()
            await endpoint.stop()
        return episode, tok

    return asyncio.run(main())


def chars(tok, text: str) -> list[int]:
    """How the fake model emits `text`: one token per character."""
    return [i for ch in text for i in tok.encode(ch)]


def test_two_chat_turns_extend_one_episode_token_exactly(tmp_path):
    async def test(client, episode, session, endpoint):
        first = await client.chat.completions.create(model="m", messages=USER, max_tokens=64, logprobs=True)
        assert first.choices[0].message.content == " 7; a: 7+3=0."
        assert first.choices[0].finish_reason == "stop"
        prompt_tokens = len(episode.prompt_ids)
        # 13 characters, one token each, and the end-of-turn token
        assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (prompt_tokens, 14)
        assert first.model == "m" and first.object == "chat.completion"
        logprobs = first.choices[0].logprobs.content
        assert [t.logprob for t in logprobs[:3]] == [-0.0, -0.01, -0.02]
        assert "".join(t.token for t in logprobs) == " 7; a: 7+3=0.<|im_end|>"
        messages = USER + [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Say the answer."},
        ]
        second = await client.chat.completions.create(model="m", messages=messages, max_tokens=64, stop=["."])
        assert second.choices[0].message.content == "The answer is 0."
        assert episode.generate_calls == [(64, None), (64, (".",))]
        assert [c.start for c in session.completions] == [prompt_tokens, second.usage.prompt_tokens]
        assert session.completions[1].versions == [3] * 17
        assert session.completions[1].logprobs[0] == -(second.usage.prompt_tokens - prompt_tokens) / 100

    episode, tok = serve(chat_model_dir(tmp_path), [" 7; a: 7+3=0.", "The answer is 0."], test)
    first = chars(tok, " 7; a: 7+3=0.") + tok.encode("<|im_end|>")
    delta = tok.encode("\n<|im_start|>user\nSay the answer.<|im_end|>\n<|im_start|>assistant\n")
    second = chars(tok, "The answer is 0.") + tok.encode("<|im_end|>")
    # the model's first turn is kept as generated (re-encoded, it would be other, fewer tokens)
    assert len(tok.encode(" 7; a: 7+3=0.<|im_end|>")) < len(first)
    assert episode.state.output_ids == first + delta + second
    assert episode.state.loss_mask == [1] * len(first) + [0] * len(delta) + [1] * len(second)


def test_a_history_that_does_not_extend_the_episode_is_refused_and_changes_nothing(tmp_path):
    async def test(client, episode, session, endpoint):
        first = await client.chat.completions.create(model="m", messages=USER)
        reply = first.choices[0].message.content
        before = list(episode.token_ids)
        refused = [
            (USER + [{"role": "assistant", "content": reply + " (edited)"}, {"role": "user", "content": "again"}],
             "message 1 does not extend this session's episode: it has assistant: ' 7; a: 7\\+3=0. \\(edited\\)'"),
            ([{"role": "system", "content": "Be brief."}, *USER], "message 0 does not extend"),
            (USER, "fewer than the episode's 2"),
            (USER + [{"role": "assistant", "content": reply}], "exactly one new message \\(got 0\\)"),
            (USER + [{"role": "assistant", "content": reply}, {"role": "user", "content": "a"},
                     {"role": "user", "content": "b"}], "exactly one new message \\(got 2\\)"),
            (USER + [{"role": "assistant", "content": reply}, {"role": "system", "content": "a"}],
             "role must be 'user' or 'tool'"),
        ]  # fmt: skip
        for messages, reason in refused:
            with pytest.raises(openai.BadRequestError, match=reason):
                await client.chat.completions.create(model="m", messages=messages)
        assert episode.token_ids == before and len(episode.generate_calls) == 1
        assert session.error is None  # the agent may correct itself
        # the reply as the client parsed it (extra fields, stripped whitespace) is the same reply
        parsed = first.choices[0].message.to_dict()
        parsed["content"] = parsed["content"].strip()
        again = await client.chat.completions.create(
            model="m", messages=USER + [parsed, {"role": "tool", "content": "0"}]
        )
        assert again.choices[0].message.content == "0"

    serve(chat_model_dir(tmp_path), [" 7; a: 7+3=0.", "0"], test)


def test_the_first_request_must_be_the_prompts_messages(tmp_path):
    async def test(client, episode, session, endpoint):
        with pytest.raises(openai.BadRequestError, match="first request must be the prompt's messages"):
            await client.chat.completions.create(
                model="m", messages=USER + [{"role": "user", "content": "hi"}]
            )
        with pytest.raises(openai.BadRequestError, match="message 0 does not extend"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "other"}])
        assert episode.generate_calls == []

    serve(chat_model_dir(tmp_path), [], test)


def test_completions_take_the_episode_text_or_its_token_ids(tmp_path):
    async def test(client, episode, session, endpoint):
        first = await client.completions.create(model="m", prompt=QUESTION, max_tokens=32, logprobs=1)
        # raw text, end token included: prompt + text is the episode so far
        assert first.choices[0].text == " 7; a: 7+3=0.<|endoftext|>"
        assert first.choices[0].logprobs.token_logprobs[-1] == -0.13
        assert first.object == "text_completion"
        prompt = QUESTION + first.choices[0].text + "\nCheck:"
        second = await client.completions.create(model="m", prompt=prompt, max_tokens=3)
        assert (second.choices[0].finish_reason, second.choices[0].text) == ("length", " ok")
        assert len(QUESTION) == 29  # then " 7" (the episode) against " 8"
        with pytest.raises(openai.BadRequestError, match="differs from the episode at character 30"):
            await client.completions.create(model="m", prompt=QUESTION + " 8")
        ids = list(episode.token_ids) + [5, 6]
        third = await client.completions.create(model="m", prompt=ids)
        assert third.usage.prompt_tokens == len(ids)
        with pytest.raises(openai.BadRequestError, match="do not start with this session's"):
            await client.completions.create(model="m", prompt=[1, 2, 3])
        with pytest.raises(openai.BadRequestError, match="uses /v1/completions: one API per session"):
            await client.chat.completions.create(model="m", messages=USER)

    model = chat_model_dir(tmp_path, template=None, eos="<|endoftext|>")
    episode, tok = serve(model, [" 7; a: 7+3=0.", " ok.", "x"], test, max_turns=4)
    assert episode.state.loss_mask[-4:] == [0, 0, 1, 1]  # the two appended ids, then "x" and its end token
    assert (
        tok.decode_raw(episode.state.output_ids[14:])
        == "\nCheck: ok" + tok.decode_raw([5, 6]) + "x<|endoftext|>"
    )


def test_raw_chat_without_a_template_appends_the_new_message_after_the_end_token(tmp_path):
    async def test(client, episode, session, endpoint):
        first = await client.chat.completions.create(model="m", messages=USER)
        messages = USER + [first.choices[0].message.to_dict(), {"role": "user", "content": "Again."}]
        await client.chat.completions.create(model="m", messages=messages)

    model = chat_model_dir(tmp_path, template=None, eos="<|endoftext|>")
    episode, tok = serve(model, ["7", "0"], test)
    assert tok.decode_raw(episode.state.output_ids) == "7<|endoftext|>\nAgain.\n0<|endoftext|>"


def test_reward_post_ends_the_episode(tmp_path):
    async def test(client, episode, session, endpoint):
        await client.chat.completions.create(model="m", messages=USER)
        reply = await client.post("/reward", cast_to=object, body={"reward": 0.5})
        assert reply == {"session": session.sid, "reward": 0.5, "num_turns": 1}
        assert session.reward == 0.5
        with pytest.raises(openai.BadRequestError, match="ended: its reward was posted"):
            await client.chat.completions.create(model="m", messages=USER)
        with pytest.raises(openai.BadRequestError, match="ended"):
            await client.post("/reward", cast_to=object, body={"reward": 1.0})
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{endpoint.url}/sessions/{session.sid}") as response:
                summary = await response.json()
        assert summary["reward"] == 0.5 and summary["completions"][0]["versions"] == [3, 3]
        assert summary["loss_mask"] == [1, 1]

    serve(chat_model_dir(tmp_path), ["1"], test)


def test_unsupported_requests_are_refused_with_the_reason(tmp_path):
    async def test(client, episode, session, endpoint):
        cases = [
            ({"stream": True}, "non-streaming requests only"),
            ({"n": 2}, "n must be 1"),
            ({"max_tokens": 0}, "positive integer"),
            ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool definitions"),
        ]
        for extra, reason in cases:
            with pytest.raises(openai.BadRequestError, match=reason):
                await client.chat.completions.create(model="m", messages=USER, **extra)
        with pytest.raises(openai.BadRequestError, match="images"):
            await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            )
        with pytest.raises(openai.BadRequestError, match="reward' must be a finite number"):
            await client.post("/reward", cast_to=object, body={"reward": "high"})
        assert episode.generate_calls == []
        assert [m.id for m in (await client.models.list()).data] == ["areal-policy"]
        endpoint.close(session.sid)
        with pytest.raises(openai.NotFoundError, match="unknown session"):
            await client.chat.completions.create(model="m", messages=USER)

    serve(chat_model_dir(tmp_path), [], test)


def test_turn_limit_and_one_request_at_a_time(tmp_path):
    async def test(client, episode, session, endpoint):
        gate = asyncio.Event()
        generate = episode.generate

        async def held(*args, **kwargs):
            await gate.wait()
            return await generate(*args, **kwargs)

        episode.generate = held
        running = asyncio.create_task(client.chat.completions.create(model="m", messages=USER))
        while not session._busy:
            await asyncio.sleep(0)
        with pytest.raises(openai.BadRequestError, match="one request at a time"):
            await client.chat.completions.create(model="m", messages=USER)
        gate.set()
        first = await running
        history = USER + [first.choices[0].message.to_dict(), {"role": "user", "content": "x"}]
        with pytest.raises(openai.BadRequestError, match=r"1 model turns \(rollout.workflow.max_turns=1\)"):
            await client.chat.completions.create(model="m", messages=history)

    serve(chat_model_dir(tmp_path), ["1", "2"], test, max_turns=1)


def test_a_failed_generation_fails_the_session_for_its_workflow(tmp_path):
    async def test(client, episode, session, endpoint):
        episode.fail_with = RuntimeError("server gone")
        with pytest.raises(openai.InternalServerError, match="RuntimeError: server gone"):
            await client.chat.completions.create(model="m", messages=USER)
        assert isinstance(session.error, RuntimeError)
        with pytest.raises(openai.BadRequestError, match="episode failed: server gone"):
            await client.chat.completions.create(model="m", messages=USER)

    serve(chat_model_dir(tmp_path), [], test)


def test_closing_a_session_stops_its_turn_in_progress(tmp_path):
    async def test(client, episode, session, endpoint):
        started, cancelled = asyncio.Event(), []

        async def forever(*args, **kwargs):
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        episode.generate = forever
        running = asyncio.create_task(client.chat.completions.create(model="m", messages=USER))
        await started.wait()
        endpoint.close(session.sid)  # the workflow returned without waiting for this request
        with pytest.raises(openai.APIError):
            await running
        assert cancelled == [True] and episode.state.output_ids == []

    serve(chat_model_dir(tmp_path), [], test)
