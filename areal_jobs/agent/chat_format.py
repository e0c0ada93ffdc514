"""Chat messages -> the exact text the policy sees, and the token-exact extension rule.

The OpenAI-compatible endpoint (endpoint.py) receives an agent's whole history on every request.
It never re-tokenises what the model said; instead it checks that the history, rendered with the
tokenizer's own chat template (data/chat.py), *extends* the episode so far, as text:

    episode text  = decode_raw(ctx.token_ids)          prompt + model turns + appended turns
    rendered text = template(messages, add_generation_prompt=True)
    rendered == episode text + delta   ->   ctx.append(encode(delta)), then generate
    otherwise                          ->   HistoryMismatch (HTTP 400, naming where they differ)

Comparing text, not token ids, is what makes the rule hold for sampled output: a sampled turn is
often not the canonical tokenisation of its own text (re-encoding `decode(ids)` gives other ids),
so a token-level comparison would reject honest agents. The episode's token ids are never
replaced; only the delta (new user / tool messages and the template's markup) is tokenised.

A model without a chat template gets a raw rendering (`data.chat_template=none` too): the first
user message framed as the dataset frames it (`PromptFormat.raw_frame`), an assistant message as
its content followed by the end-of-sequence token (where the model stopped), any other message as
"\\n{content}\\n".
"""

from __future__ import annotations

from collections.abc import Callable

from areal_jobs.data.chat import PromptFormat, _compile

Message = dict[str, str]
_SENTINEL = "\x00areal-user-turn\x00"  # never in a dataset's text


class HistoryMismatch(ValueError):
    """The agent's history does not extend the episode (its message says where and how)."""


def message_text(message: dict) -> str:
    """An OpenAI message's content as text: a string, or a list of {"type": "text"} parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ValueError("message content must be text or a list of {'type': 'text'} parts (no images, audio)")


class ChatFormat:
    """The policy's chat rendering and raw decoding, as the controller has it (one per process)."""

    def __init__(self, fmt: PromptFormat, encode: Callable[[str], list[int]], decode_raw: Callable) -> None:
        self.fmt = fmt
        self.encode = encode
        self.decode_raw = decode_raw  # token ids -> text with special tokens: what the model saw
        self._template = _compile(fmt.template_source) if fmt.template_source else None
        self.eos_token = fmt.specials.get("eos_token", "")

    def render(self, messages: list[Message]) -> str:
        """The prompt text for `messages`, ending with the next assistant turn's generation prompt."""
        if not messages:
            raise ValueError("messages is empty")
        for message in messages:
            if message.get("role") not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"unknown message role {message.get('role')!r}")
        if messages[-1]["role"] == "assistant":
            raise ValueError("the last message is the assistant's: send the next user or tool message")
        plain = [{**m, "content": message_text(m)} for m in messages]
        if self._template is not None:
            return self._template.render(messages=plain, add_generation_prompt=True, **self.fmt.specials)
        return self._render_raw(plain)

    def _render_raw(self, messages: list[Message]) -> str:
        system = ""
        if messages[0]["role"] == "system":
            system, messages = messages[0]["content"], messages[1:]
        if not messages or messages[0]["role"] != "user":
            raise ValueError("without a chat template the history must start with a user message")
        framed = self.fmt.raw_frame.format(user=messages[0]["content"])
        parts = [f"{system}\n\n{framed}" if system else framed]
        for message in messages[1:]:
            if message["role"] == "assistant":
                parts.append(message["content"] + self.eos_token)
            else:
                parts.append(f"\n{message['content']}\n")
        return "".join(parts)

    def prompt_messages(self, prompt_text: str) -> list[Message]:
        """The chat messages that render to `prompt_text` (a dataset prompt, already rendered):
        the system prompt, if configured, and the user turn; [] when no user text renders to it
        (a template that rewrites the user's text), in which case agents use `prompt_text`."""
        head = [{"role": "system", "content": self.fmt.system_prompt}] if self.fmt.system_prompt else []
        before, _, after = self.render([*head, {"role": "user", "content": _SENTINEL}]).partition(_SENTINEL)
        if not (prompt_text.startswith(before) and prompt_text.endswith(after)):
            return []
        if len(prompt_text) < len(before) + len(after):
            return []
        user = prompt_text[len(before) : len(prompt_text) - len(after)]
        messages = [*head, {"role": "user", "content": user}]
        return messages if self.render(messages) == prompt_text else []

    def extension(self, episode_ids: list[int], rendered: str) -> list[int]:
        """Token ids to append so the episode becomes `rendered`; HistoryMismatch if it cannot."""
        episode_text = self.decode_raw(episode_ids)
        if not rendered.startswith(episode_text):
            raise HistoryMismatch(describe_mismatch(episode_text, rendered))
        delta = rendered[len(episode_text) :]
        return self.encode(delta) if delta else []


def describe_mismatch(episode_text: str, rendered: str, context_chars: int = 40) -> str:
    """Where the request's rendered history leaves the episode, with a little text either side."""
    at = next(
        (i for i, (a, b) in enumerate(zip(episode_text, rendered)) if a != b),
        min(len(episode_text), len(rendered)),
    )
    lo = max(0, at - context_chars)
    if at == len(rendered):
        how = f"the request's history is shorter than the episode ({len(rendered)} < {len(episode_text)} chars)"
    else:
        how = f"they differ at character {at}"
    return (
        "the request's history does not extend this session's episode: "
        f"{how}; episode: {episode_text[lo : at + context_chars]!r}, "
        f"request: {rendered[lo : at + context_chars]!r}. Send the earlier messages unchanged, "
        "with each assistant reply exactly as this endpoint returned it, then the new messages "
        "(docs/agents.md, 'Token-exact histories')"
    )
