"""What an agent may send: the session's history rule and the prompt's messages (chat_history.py)."""

from __future__ import annotations

import pytest

from areal_jobs.agent.chat_history import (
    ChatHistory,
    HistoryMismatch,
    message_text,
    prompt_messages,
    text_delta,
)

CHATML_USER = "<|im_start|>user\n\x00areal-user-turn\x00<|im_end|>\n<|im_start|>assistant\n"


def test_prompt_messages_cut_the_user_text_out_of_the_rendered_prompt():
    prompt = "<|im_start|>system\nBe exact.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert prompt_messages(prompt, CHATML_USER, "fallback") == [{"role": "user", "content": "What is 2+3?"}]
    llama_user = (
        "<|start_header_id|>user<|end_header_id|>\n\n\x00areal-user-turn\x00<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    llama = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nToday<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nQ: 1<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert prompt_messages(llama, llama_user, "fallback") == [{"role": "user", "content": "Q: 1"}]


def test_prompt_messages_fall_back_to_the_prompt_text():
    # raw rendering ("\n{content}\n") frames nothing; a template that rewrote the user's text
    assert prompt_messages("Q: start 7\nA:", "\n\x00areal-user-turn\x00\n", "Q: start 7\nA:") == [
        {"role": "user", "content": "Q: start 7\nA:"}
    ]
    assert prompt_messages("<|im_start|>user\nQ<|im_end|>\n", CHATML_USER, "Q") == [
        {"role": "user", "content": "Q"}
    ]


def test_history_grows_by_one_new_message_and_the_reply_per_turn():
    history = ChatHistory([{"role": "user", "content": "Q"}])
    assert history.new_message([{"role": "user", "content": "Q"}]) is None
    history.commit(None, " 7.")
    sent = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "7."},
        {"role": "tool", "content": "r"},
    ]
    new = history.new_message(sent)
    assert (new.role, new.content) == ("tool", "r")
    history.commit(new, "done")
    assert [(m.role, m.content) for m in history.messages] == [
        ("user", "Q"), ("assistant", " 7."), ("tool", "r"), ("assistant", "done")
    ]  # fmt: skip
    with pytest.raises(
        HistoryMismatch, match="message 2 does not extend .* it has tool: 'R', the episode has tool: 'r'"
    ):
        history.new_message(
            sent[:2] + [{"role": "tool", "content": "R"}, {"role": "assistant", "content": "done"}]
        )
    with pytest.raises(HistoryMismatch, match="message 0 is not a message object"):
        history.new_message(["Q"])


def test_message_text_joins_text_parts_and_refuses_others():
    assert (
        message_text(
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        )
        == "ab"
    )
    assert message_text({"role": "assistant", "content": None}) == ""
    with pytest.raises(HistoryMismatch, match="no images"):
        message_text({"role": "user", "content": [{"type": "input_audio"}]})


def test_text_delta_is_what_the_prompt_adds_and_a_mismatch_says_where():
    assert text_delta("abc<|im_end|>", "abc<|im_end|>\nmore") == "\nmore"
    assert text_delta("abc", "abc") == ""
    with pytest.raises(
        HistoryMismatch, match="differs from the episode at character 1; episode: 'abc', prompt: 'aXc'"
    ):
        text_delta("abc", "aXc")
    with pytest.raises(HistoryMismatch, match=r"shorter than the episode \(2 < 3 characters\)"):
        text_delta("abc", "ab")
