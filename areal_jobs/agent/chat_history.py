"""What an agent may send the endpoint: a history that extends its session's episode.

The endpoint never re-renders or re-tokenises what is already in the episode. A request is checked
against the episode and only what it adds is tokenised and appended (loss mask 0):

    chat          request.messages == the session's history + one new "user" or "tool" message
                  history = the prompt's messages (given to the agent), then per model turn the new
                  message and the reply exactly as returned (an assistant reply may differ only by
                  surrounding whitespace); the new message is rendered by ctx.render_message with
                  the tokenizer's own chat template (data/chat.py), after the model's turn
    completions   prompt text == decode_raw(episode) + new text        (special tokens as text)
                  prompt ids  == episode token ids + new ids

Anything else is refused (HTTP 400) with where the request leaves the episode. Checking messages,
not a re-rendered text, keeps the rule exact for sampled turns (rarely the canonical tokenisation
of their own text) and for templates that rewrite earlier turns (e.g. drop a reasoning block):
the model saw the episode's tokens, and the agent's history is only compared with them.
"""

from __future__ import annotations

from dataclasses import dataclass

NEW_MESSAGE_ROLES = ("user", "tool")  # what ctx.render_message renders after a model turn
USER_SENTINEL = "\x00areal-user-turn\x00"  # a user message content never in a dataset: marks where it goes


class HistoryMismatch(ValueError):
    """The request does not extend the episode (its message says where and how)."""


def message_text(message: dict) -> str:
    """An OpenAI message's content as text: a string, or a list of {"type": "text"} parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise HistoryMismatch(
        "message content must be text or a list of {'type': 'text'} parts (no images, audio)"
    )


@dataclass(frozen=True)
class Message:
    role: str
    content: str

    def same_as(self, other: Message) -> bool:
        if self.role != other.role:
            return False
        if self.role == "assistant":  # agents often strip replies; the episode keeps the tokens
            return self.content.strip() == other.content.strip()
        return self.content == other.content


class ChatHistory:
    """A session's conversation as the agent must send it back: prompt messages, then turns."""

    def __init__(self, prompt_messages: list[dict]) -> None:
        self.messages = [Message(m["role"], m["content"]) for m in prompt_messages]
        self.num_turns = 0

    def new_message(self, request: list) -> Message | None:
        """The one message `request` adds to the history (None before the first model turn, when
        the request must be the prompt's messages); HistoryMismatch otherwise."""
        got = []
        for i, m in enumerate(request):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise HistoryMismatch(f"message {i} is not a message object with a role")
            got.append(Message(m["role"], message_text(m)))
        for i, (want, have) in enumerate(zip(self.messages, got)):
            if not want.same_as(have):
                raise HistoryMismatch(
                    f"message {i} does not extend this session's episode: it has {have.role}: "
                    f"{_clip(have.content)}, the episode has {want.role}: {_clip(want.content)}. " + _RULE
                )
        extra = got[len(self.messages) :]
        if len(got) < len(self.messages):
            raise HistoryMismatch(
                f"the request has {len(got)} messages, fewer than the episode's {len(self.messages)}. "
                + _RULE
            )
        if self.num_turns == 0:
            if extra:
                raise HistoryMismatch(
                    "the first request must be the prompt's messages as given to the agent, nothing more "
                    "(the prompt ends with the assistant's generation prompt; instructions belong in "
                    "data.system_prompt / data.instruction)"
                )
            return None
        if len(extra) != 1:
            raise HistoryMismatch(
                f"after a model turn send exactly one new message (got {len(extra)}): a 'user' or 'tool' "
                "message after the assistant's reply; join several tool results into one"
            )
        if extra[0].role not in NEW_MESSAGE_ROLES:
            raise HistoryMismatch(f"the new message's role must be 'user' or 'tool', not {extra[0].role!r}")
        return extra[0]

    def commit(self, new: Message | None, reply: str) -> None:
        """The turn was generated: the new message and the reply join the history."""
        self.messages += ([new] if new is not None else []) + [Message("assistant", reply)]
        self.num_turns += 1


_RULE = (
    "Send the earlier messages unchanged, with each assistant reply as this endpoint returned it, "
    "then one new message (docs/agents.md, 'Token-exact histories')"
)


def prompt_messages(prompt_text: str, user_opening: str, fallback: str) -> list[dict]:
    """The chat messages an agent gets for a prompt already rendered to `prompt_text`.

    `user_opening` is how the template renders a user message whose content is USER_SENTINEL (with
    the next generation prompt): the prompt ends the same way around the user's text, which is
    cut out. Where it does not (raw prompts, a template that rewrites the user's text), the user
    message is `fallback` (the prompt's text without special tokens). The system block, if any,
    stays in the prompt's tokens: it is not a message the agent sends."""
    before, found, after = user_opening.partition(USER_SENTINEL)
    if found and before.strip() and prompt_text.endswith(after):  # raw "\n{content}\n": no frame
        head = prompt_text[: len(prompt_text) - len(after)]
        at = head.rfind(before)
        if at >= 0:
            return [{"role": "user", "content": head[at + len(before) :]}]
    return [{"role": "user", "content": fallback}]


def text_delta(episode_text: str, prompt_text: str) -> str:
    """What a completions prompt adds to the episode's text; HistoryMismatch if it does not extend it."""
    if prompt_text.startswith(episode_text):
        return prompt_text[len(episode_text) :]
    at = next(
        (i for i, (a, b) in enumerate(zip(episode_text, prompt_text)) if a != b),
        min(len(episode_text), len(prompt_text)),
    )
    if at == len(prompt_text):
        how = f"it is shorter than the episode ({len(prompt_text)} < {len(episode_text)} characters)"
    else:
        how = f"it differs from the episode at character {at}"
    lo = max(0, at - 40)
    raise HistoryMismatch(
        f"the prompt does not extend this session's episode: {how}; episode: "
        f"{episode_text[lo : at + 40]!r}, prompt: {prompt_text[lo : at + 40]!r}. Send the earlier "
        "prompt and each completion's text unchanged (special tokens included), then new text"
    )


def _clip(text: str, chars: int = 80) -> str:
    return repr(text if len(text) <= chars else text[:chars] + "...")
