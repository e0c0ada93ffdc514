"""EpisodeContext over the real GenerationPath and a scripted server: token-exact turns, the loss
mask, per-token versions across an interruption, replay on resume, and the built-in workflows."""

import asyncio
import copy

import pytest

from areal_jobs.agent.context import EpisodeError, run_episode
from areal_jobs.agent.episode import EpisodeState
from areal_jobs.agent.multi_turn_math import multi_turn_math
from areal_jobs.agent.single_turn import single_turn
from areal_jobs.config import WorkflowConfig

from .scripted import ABORT, LENGTH, PROMPT, Harness, Scripted, answer, encode

FEEDBACK = encode("\nYour answer is incorrect. Try again.\n")


def test_single_turn_is_one_answer_scored_by_its_text():
    server = Scripted([answer([3, 7, 0])])
    h = Harness(server)
    state = EpisodeState("g/0")
    asyncio.run(run_episode(single_turn, h.context(state)))
    assert state.output_ids == [3, 7, 0] and state.loss_mask == [1, 1, 1]
    assert (state.reward, state.reward_status, state.num_turns) == (1.0, "ok", 1)
    assert [r.rid for r in server.requests] == ["r.0"] and server.requests[0].input_ids == [1, 2]


def test_three_turns_mask_exactly_the_model_tokens_and_discount_the_reward():
    # wrong, wrong, right: reward 0.5**2; the feedback (user) tokens have mask 0 and log-prob 0
    server = Scripted([answer([3, 4]), answer([5], LENGTH), answer([7, 0])])
    h = Harness(server)
    state = EpisodeState("g/0")
    asyncio.run(run_episode(multi_turn_math, h.context(state)))
    n = len(FEEDBACK)
    assert state.output_ids == [3, 4, *FEEDBACK, 5, *FEEDBACK, 7, 0]
    assert state.loss_mask == [1, 1] + [0] * n + [1] + [0] * n + [1, 1]
    assert state.logprobs == [-0.5, -0.5] + [0.0] * n + [-0.5] + [0.0] * n + [-0.5, -0.5]
    assert state.reward == pytest.approx(0.25) and state.num_turns == 3 and state.finish_reason == "stop"
    # each turn is sent as prompt + every episode token so far, under its own request id
    assert [r.input_ids for r in server.requests] == [
        [1, 2],
        [1, 2, 3, 4, *FEEDBACK],
        [1, 2, *state.output_ids[:-2]],
    ]
    assert [r.rid for r in server.requests] == ["r.0", "r-t1.0", "r-t2.0"]
    assert h.scored == ["de", "f", "The answer is 7."]


def test_never_right_in_max_turns_earns_zero_and_no_feedback_after_the_last_turn():
    server = Scripted([answer([3]), answer([4])])
    h = Harness(server, WorkflowConfig(name="multi_turn_math", max_turns=2, max_episode_tokens=1000))
    state = EpisodeState("g/0")
    asyncio.run(run_episode(multi_turn_math, h.context(state)))
    assert state.reward == 0.0 and state.output_ids == [3, *FEEDBACK, 4] and len(server.requests) == 2


def test_an_update_in_turn_2_continues_the_turn_under_the_new_version_token_by_token():
    # turn 2's first segment is aborted by the update to version 1; its continuation is stamped 1,
    # the feedback tokens carry the version when they were appended (0)
    def update_at_turn_2(request):  # the update lands while turn 2's first segment is out
        if request.rid == "r-t1.0":
            h.version = 1

    server = Scripted(
        [answer([3]), answer([4, 5], ABORT), answer([7, 0], version=1)], before=update_at_turn_2
    )
    h = Harness(server)
    state = EpisodeState("g/0")
    asyncio.run(run_episode(multi_turn_math, h.context(state)))
    n = len(FEEDBACK)
    assert state.versions == [0] + [0] * n + [0, 0, 1, 1]
    assert state.interruptions == 1 and state.reward == 0.5
    assert (
        server.requests[2].input_ids == [1, 2, 3, *FEEDBACK, 4, 5] and server.requests[2].max_new_tokens == 8
    )


def test_a_restored_episode_replays_its_turns_and_continues_the_turn_in_progress():
    saved = {}

    def snapshot_in_turn_2(request):  # the checkpoint is taken while turn 2's continuation is out
        if request.rid == "r-t1.1":
            saved["state"] = copy.deepcopy(state)

    first = Scripted(
        [answer([3]), answer([4, 5], ABORT), answer([6, 0]), answer([7])], before=snapshot_in_turn_2
    )
    state = EpisodeState("g/0")
    asyncio.run(run_episode(multi_turn_math, Harness(first).context(state)))
    restored = saved["state"]
    assert restored.events[-1] == ["model", 1 + len(FEEDBACK), 3 + len(FEEDBACK), ""]

    # a fresh controller: turn 1 is replayed (no request), turn 2 goes on from its 2 tokens
    second = Scripted([answer([7, 0], version=1)])
    h = Harness(second)
    h.version = 1
    asyncio.run(run_episode(multi_turn_math, h.context(restored)))
    assert [r.input_ids for r in second.requests] == [[1, 2, 3, *FEEDBACK, 4, 5]]
    assert second.requests[0].max_new_tokens == 8
    assert restored.reward == 0.5 and restored.output_ids[-4:] == [4, 5, 7, 0]
    assert restored.versions[-4:] == [0, 0, 1, 1] and h.scored == ["d", "efThe answer is 7."]


def test_a_finished_episode_replays_without_a_request_or_a_tool_run():
    calls = []

    async def tool(name, arguments):
        calls.append((name, arguments))
        return "42"

    async def with_tool(ctx):
        await ctx.generate()
        result = await ctx.call_tool("calculator", "6*7")
        ctx.append(ctx.encode(result))
        turn = await ctx.generate()
        return (await ctx.score(turn.text)).reward

    state = EpisodeState("g/0")
    h = Harness(Scripted([answer([3]), answer([7])]), call_tool=tool)
    asyncio.run(run_episode(with_tool, h.context(state)))
    replayed = copy.deepcopy(state)
    replayed.reward_status = ""
    h2 = Harness(Scripted([]), call_tool=tool)
    asyncio.run(run_episode(with_tool, h2.context(replayed)))
    assert calls == [("calculator", "6*7")] and replayed == state and state.num_tool_calls == 1


def test_a_workflow_that_diverges_from_its_recording_ends_its_episode_with_an_error():
    state = EpisodeState("g/0")
    h = Harness(Scripted([answer([3]), answer([7])]))
    asyncio.run(run_episode(multi_turn_math, h.context(state)))

    async def other(ctx):
        await ctx.generate()
        ctx.append([99])  # the recording appended the feedback
        return 1.0

    replayed = copy.deepcopy(state)
    asyncio.run(run_episode(other, h.context(replayed)))
    assert (replayed.reward, replayed.reward_status) == (0.0, "error")
    with pytest.raises(EpisodeError, match="the workflow did 'env' where the recording has 'model'"):
        ctx = h.context(copy.deepcopy(state))
        ctx.append([99])


def test_the_episode_token_budget_caps_the_last_turn():
    server = Scripted([answer([3, 4, 5, 6]), answer([8, 9, 9])])
    config = WorkflowConfig(name="multi_turn_math", max_turns=2, max_episode_tokens=4 + len(FEEDBACK) + 3)
    asyncio.run(run_episode(multi_turn_math, Harness(server, config).context(EpisodeState("g/0"))))
    assert [r.max_new_tokens for r in server.requests] == [10, 3]


def test_render_message_drops_the_end_of_turn_text_the_model_already_produced(tmp_path):
    import json

    from areal_jobs.config import DataConfig, Dataset
    from areal_jobs.data.chat import PromptFormat

    chatml = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
        " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": chatml}))
    fmt = PromptFormat.load(DataConfig(dataset=Dataset.arith), tmp_path)
    closing, opening = fmt.message_texts("user", "Try again.")
    assert closing == "<|im_end|>\n"
    assert opening == "<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n"

    from dataclasses import replace

    from areal_jobs.agent.context import EpisodeText

    words = {0: "<|im_end|>", 3: "six"}
    h = Harness(Scripted([answer([3, 0]), answer([3], LENGTH)]))
    text = EpisodeText(encode, lambda ids: "", lambda ids: "".join(words[i] for i in ids), fmt.message_texts)
    h.services = replace(h.services, text=text)
    ctx = h.context(EpisodeState("g/0"))
    asyncio.run(ctx.generate())  # ended by the end-of-turn token: only its newline is still due
    assert ctx.render_message("user", "Try again.") == encode("\n" + opening)
    ctx.append([])
    asyncio.run(ctx.generate())  # cut by length: the whole closing text is due
    assert ctx.render_message("user", "Try again.") == encode(closing + opening)
    assert PROMPT.input_ids == [1, 2]


def test_environment_tokens_carry_the_version_current_when_appended():
    h = Harness(Scripted([answer([3, 4]), answer([5], version=3)]))
    ctx = h.context(EpisodeState("g/0"))
    asyncio.run(ctx.generate())
    h.version = 3  # an update landed between the turns
    ctx.append([9, 9])
    asyncio.run(ctx.generate())
    assert ctx.state.versions == [0, 0, 3, 3, 3] and ctx.state.loss_mask == [1, 1, 0, 0, 1]
    assert ctx.state.oldest_model_version() == 0 and (ctx.num_turns, ctx.version) == (2, 3)
