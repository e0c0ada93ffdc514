"""A stand-in EpisodeContext for unit tests of the endpoint (the real one runs against real
SGLang in tests/integration), and a tokenizer with real chat special tokens.

The fake's model turns are scripted text, tokenised one character at a time: a sampled turn is
rarely the canonical tokenisation of its text, and this one never is, so a test that passes with
it shows the endpoint never re-tokenises what the model said.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from areal_jobs.agent.chat_format import ChatFormat
from areal_jobs.config import DataConfig
from areal_jobs.data.chat import PromptFormat
from areal_jobs.data.tokenizer import TextTokenizer

BUILTIN = Path(__file__).resolve().parents[3] / "areal_jobs" / "data" / "builtin_model"
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


def chat_format(model_dir: Path, **data) -> tuple[ChatFormat, TextTokenizer]:
    tok = TextTokenizer(model_dir)
    fmt = PromptFormat.load(DataConfig(**data), model_dir)
    return ChatFormat(fmt, tok.encode, tok.decode_raw), tok


@dataclass
class Turn:
    token_ids: list[int]
    text: str
    finish_reason: str


class FakeEpisode:
    """prompt + episode tokens with the loss mask and versions the real context keeps."""

    def __init__(self, tok: TextTokenizer, prompt_ids: list[int], replies: list[str], end_token: str = "<|im_end|>"):
        self.tok = tok
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.versions: list[int] = []
        self.replies = list(replies)  # one per generate; a reply without end token ends by length
        self.end_id = tok._tok.token_to_id(end_token)
        self.version = 3
        self.generate_calls: list[tuple[int | None, tuple[str, ...] | None]] = []
        self.fail_with: BaseException | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    async def generate(self, max_new_tokens=None, stop=None) -> Turn:
        self.generate_calls.append((max_new_tokens, stop))
        if self.fail_with is not None:
            raise self.fail_with
        text = self.replies.pop(0)
        ids = [i for ch in text for i in self.tok.encode(ch)] + [self.end_id]
        finish = "stop"
        if max_new_tokens is not None and len(ids) > max_new_tokens:
            ids, finish = ids[:max_new_tokens], "length"
        self._add(ids, 1)
        return Turn(ids, self.tok.decode(ids), finish)

    def append(self, token_ids: list[int]) -> None:
        self._add(list(token_ids), 0)

    def _add(self, ids: list[int], mask: int) -> None:
        self.output_ids += ids
        self.loss_mask += [mask] * len(ids)
        self.versions += [self.version] * len(ids)
