"""A stand-in EpisodeContext for unit tests of the endpoint (the real one runs against real
SGLang in tests/integration), and a tokenizer with real chat special tokens.

The fake's model turns are scripted text, tokenised one character at a time: a sampled turn is
rarely the canonical tokenisation of its text, and this one never is, so a test that passes with
it shows the endpoint never re-tokenises what the model said.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from areal_jobs.config import DataConfig
from areal_jobs.data.chat import PromptFormat
from areal_jobs.data.tokenizer import TextTokenizer

BUILTIN = Path(__file__).resolve().parents[3] / "areal_jobs" / "tasks" / "models" / "builtin_model"
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chat_model_dir(folder: Path, template: str | None = CHATML, eos: str = "<|im_end|>") -> Path:
    """The built-in byte-level tokenizer plus ChatML's special tokens, with `template` (or none)."""
    tok = Tokenizer.from_file(str(BUILTIN / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": eos}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def prompt_format(model_dir: Path, **data) -> tuple[PromptFormat, TextTokenizer]:
    return PromptFormat.load(DataConfig(**data), model_dir), TextTokenizer(model_dir)


@dataclass
class Turn:
    token_ids: list[int]
    text: str
    finish_reason: str


@dataclass
class State:
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)


class FakeEpisode:
    """prompt + episode tokens with the log-probs, versions and loss mask the real context keeps."""

    def __init__(
        self, tok: TextTokenizer, chat: bool, prompt_ids: list[int], replies: list[str], end_token: str
    ):
        self.tok = tok
        self.chat = chat  # ChatML messages, else raw "\n{content}\n"
        self.prompt_ids = list(prompt_ids)
        self.state = State()
        self.replies = list(replies)  # one per generate; the end token is added
        self.end_id = tok._tok.token_to_id(end_token)
        self.version = 3
        self.generate_calls: list[tuple[int | None, tuple[str, ...] | None]] = []
        self.fail_with: BaseException | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.state.output_ids

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    async def generate(self, max_new_tokens=None, stop=None) -> Turn:
        self.generate_calls.append((max_new_tokens, stop))
        if self.fail_with is not None:
            raise self.fail_with
        ids = [i for ch in self.replies.pop(0) for i in self.tok.encode(ch)] + [self.end_id]
        finish = "stop"
        if max_new_tokens is not None and len(ids) > max_new_tokens:
            ids, finish = ids[:max_new_tokens], "length"
        # log-prob of the i-th token: -i/100 (hand-checkable)
        self._add(ids, 1, [-(len(self.state.output_ids) + i) / 100 for i in range(len(ids))])
        return Turn(ids, self.tok.decode(ids), finish)

    def append(self, token_ids: list[int]) -> None:
        self._add(list(token_ids), 0, [0.0] * len(token_ids))

    def render_message(self, role: str, content: str) -> list[int]:
        """As agent/context.py renders one message after a model turn (ChatML or raw)."""
        if not self.chat:
            return self.encode(f"\n{content}\n")
        closing, opening = "<|im_end|>\n", f"<|im_start|>{role}\n{content}<|im_end|>\n<|im_start|>assistant\n"
        if self.state.loss_mask and self.state.loss_mask[-1] == 1:  # after a model turn
            produced = self.tok.decode_raw(self.state.output_ids[-8:])
            k = next((k for k in range(len(closing), 0, -1) if produced.endswith(closing[:k])), 0)
            closing = closing[k:]
        else:
            closing = ""
        return self.encode(closing + opening)

    def _add(self, ids: list[int], mask: int, logprobs: list[float]) -> None:
        self.state.output_ids += ids
        self.state.logprobs += logprobs
        self.state.loss_mask += [mask] * len(ids)
        self.state.versions += [self.version] * len(ids)
