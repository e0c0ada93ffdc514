"""The endpoint's rendering and token-exact extension rule (agent/chat_format.py), by hand."""

from __future__ import annotations

import pytest
from .fake_episode import CHATML, chat_format, chat_model_dir

from areal_jobs.agent.chat_format import HistoryMismatch, describe_mismatch

QUESTION = "Q: start 7; a +3. (mod 10)\nA:"


def test_chat_history_renders_with_the_tokenizers_template(tmp_path):
    chat, _ = chat_format(chat_model_dir(tmp_path))
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "now?"}]},
    ]
    assert chat.render(messages) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyes<|im_end|>\n"
        "<|im_start|>user\nand now?<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="last message is the assistant's"):
        chat.render(messages[:2])
    with pytest.raises(ValueError, match="unknown message role"):
        chat.render([{"role": "developer", "content": "x"}])
    with pytest.raises(ValueError, match="images"):
        chat.render([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_without_a_template_the_raw_rendering_extends_where_the_model_stopped(tmp_path):
    chat, _ = chat_format(chat_model_dir(tmp_path, template=None, eos="<|endoftext|>"))
    messages = [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": " 7; a: 7+3=0. The answer is 0."},
        {"role": "user", "content": "Check it."},
    ]
    assert chat.render(messages) == (
        "Be exact.\n\n" + QUESTION + " 7; a: 7+3=0. The answer is 0.<|endoftext|>\nCheck it.\n"
    )
    with pytest.raises(ValueError, match="start with a user message"):
        chat.render([{"role": "tool", "content": "1"}])


def test_prompt_messages_recover_the_user_turn_from_the_rendered_prompt(tmp_path_factory):
    chat, _ = chat_format(chat_model_dir(tmp_path_factory.mktemp("chat")), system_prompt="Be exact.")
    prompt = "<|im_start|>system\nBe exact.<|im_end|>\n<|im_start|>user\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n"
    assert chat.prompt_messages(prompt) == [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": QUESTION},
    ]
    assert chat.prompt_messages("something else") == []
    raw, _ = chat_format(chat_model_dir(tmp_path_factory.mktemp("raw"), template=None))
    assert raw.prompt_messages(QUESTION) == [{"role": "user", "content": QUESTION}]


def test_a_template_that_rewrites_the_user_text_gives_no_messages(tmp_path):
    upper = CHATML.replace("message['content']", "message['content'] | upper")
    chat, _ = chat_format(chat_model_dir(tmp_path, template=upper))
    assert chat.prompt_messages("<|im_start|>user\nQ: 1<|im_end|>\n<|im_start|>assistant\n") == []


def test_extension_is_the_text_after_the_episode_tokenised_alone(tmp_path):
    chat, tok = chat_format(chat_model_dir(tmp_path))
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # the model's turn, one token per character: not how the tokenizer encodes "The answer"
    turn = [i for ch in "The answer" for i in tok.encode(ch)] + tok.encode("<|im_end|>")
    episode = tok.encode(prompt) + turn
    assert tok.encode("The answer") != turn[:-1]
    rendered = prompt + "The answer<|im_end|>\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
    delta = chat.extension(episode, rendered)
    assert tok.decode_raw(delta) == "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
    assert delta == tok.encode("\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n")
    assert chat.extension(episode, prompt + "The answer<|im_end|>") == []
    assert len(prompt) == 52
    with pytest.raises(HistoryMismatch, match="differ at character 52"):
        chat.extension(episode, prompt + "An answer<|im_end|>\n")


def test_mismatch_message_shows_both_sides_at_the_first_difference():
    message = describe_mismatch("abcdef", "abXdefgh", context_chars=2)
    assert "differ at character 2" in message
    assert "episode: 'abcd'" in message and "request: 'abXd'" in message
    shorter = describe_mismatch("abcdef", "abc", context_chars=2)
    assert "shorter than the episode (3 < 6 chars)" in shorter
