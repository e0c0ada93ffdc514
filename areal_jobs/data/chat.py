"""Prompts as configuration: a dataset row -> the exact text the policy sees.

    row fields ─▶ data.prompt_template (or data.prompt_key) ─▶ user text (+ data.instruction)
        ─▶ chat template (data.chat_template=auto|none|<file.jinja>, with data.system_prompt and
           the generation prompt) ─▶ text ─▶ token ids

One function, `PromptFormat.render`, builds every prompt: training, periodic and final evaluation,
and `launch.evaluate` all go through it, so the model is trained on the prompt it is scored on.
The chat template is rendered here with Jinja (as transformers' `apply_chat_template` does) so the
controller does not import transformers; special tokens in the rendered text (`<|im_start|>`)
are recognised by the tokenizer as the single tokens they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from areal_jobs.config import DataConfig, Dataset
from areal_jobs.data.formats import get_field, has_field

AUTO, NONE = "auto", "none"
STEP_BY_STEP_BOXED = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class DatasetLayout:
    """What a dataset's rows look like and how it is prompted unless the config says otherwise."""

    prompt_key: str  # the row field with the question
    answer_keys: tuple[str, ...]  # the first present one is the reference
    instruction: str  # appended to the user turn (common practice for the data)
    raw_frame: str  # data.chat_template=none (or a tokenizer without a template): "{user}" framed
    prompt_fallbacks: tuple[str, ...] = ()  # tried after prompt_key, first present wins


LAYOUTS = {
    Dataset.arith: DatasetLayout("prompt", ("answer",), "", "{user}"),
    Dataset.countdown: DatasetLayout("prompt", ("answer",), "", "{user}"),
    # DeepSeek-R1 / AReaL / verl math recipes: step by step, final answer boxed (GSM8K's reward
    # also reads "#### x" and "the answer is x")
    Dataset.gsm8k: DatasetLayout("question", ("answer",), STEP_BY_STEP_BOXED, "Question: {user}\nAnswer:"),
    Dataset.math: DatasetLayout(
        "problem", ("answer", "solution"), STEP_BY_STEP_BOXED, "Problem: {user}\nSolution:"
    ),
    Dataset.humaneval: DatasetLayout("prompt", (), "", "{user}"),
    Dataset.code_stdio: DatasetLayout("prompt", (), "", "{user}"),
    # verl: prompt (chat messages), reward_model.ground_truth; AReaL: question/answer (GSM8K),
    # messages or prompt with answer/solution. Their prompts carry their instruction already.
    Dataset.file: DatasetLayout(
        "prompt",
        ("reward_model.ground_truth", "ground_truth", "answer", "solution"),
        "",
        "{user}",
        ("messages", "question", "problem"),
    ),
}


def read_chat_template(model_dir: str | Path) -> str | None:
    """The tokenizer's own chat template: chat_template.jinja, else tokenizer_config.json's."""
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    config = model_dir / "tokenizer_config.json"
    if not config.exists():
        return None
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template or None


def special_tokens(model_dir: str | Path) -> dict[str, str]:
    """bos/eos/pad/unk token strings from tokenizer_config.json (what templates refer to)."""
    config = Path(model_dir) / "tokenizer_config.json"
    if not config.exists():
        return {}
    raw = json.loads(config.read_text(encoding="utf-8"))
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = raw.get(key)
        if isinstance(value, dict):  # AddedToken serialisation
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def chat_renderer(model_dir: str | Path, add_generation_prompt: bool):
    """messages -> text through the tokenizer's own chat template (None: it has none). For a
    reward model or judge reading a conversation (rollout/reward_client.py)."""
    source = read_chat_template(model_dir)
    if source is None:
        return None
    template, specials = _compile(source), special_tokens(model_dir)

    def render(messages: list[dict[str, str]]) -> str:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **specials)

    return render


def _compile(source: str):
    """A sandboxed Jinja template with the environment transformers gives chat templates."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


@dataclass
class PromptFormat:
    """How a row becomes the policy's prompt; built once per process by `PromptFormat.load`."""

    dataset: Dataset
    prompt_key: str
    answer_keys: tuple[str, ...]
    prompt_template: str  # "" = the row's prompt_key field
    instruction: str
    system_prompt: str
    raw_frame: str
    template_source: str | None  # None: raw text (no chat template)
    template_origin: str  # for the start-up line: "tokenizer", a file, or "none"
    specials: dict[str, str]
    prompt_fallbacks: tuple[str, ...] = ()  # the dataset's other prompt fields (data.dataset=file)

    @classmethod
    def load(cls, data: DataConfig, model_dir: str | Path) -> PromptFormat:
        layout = LAYOUTS[data.dataset]
        if data.chat_template == NONE:
            source, origin = None, NONE
        elif data.chat_template == AUTO:
            source = read_chat_template(model_dir)
            origin = (
                "auto (the tokenizer's template)" if source else "auto (none: the tokenizer has no template)"
            )
        else:
            path = Path(data.chat_template)
            if not path.is_file():
                raise FileNotFoundError(f"data.chat_template={data.chat_template}: no such Jinja file")
            source, origin = path.read_text(encoding="utf-8"), str(path)
        return cls(
            dataset=data.dataset,
            prompt_key=data.prompt_key or layout.prompt_key,
            answer_keys=(data.answer_key,) if data.answer_key else layout.answer_keys,
            prompt_template=data.prompt_template,
            instruction=layout.instruction if data.instruction is None else data.instruction,
            system_prompt=data.system_prompt,
            raw_frame=layout.raw_frame,
            template_source=source,
            template_origin=origin,
            specials=special_tokens(model_dir),
            prompt_fallbacks=() if data.prompt_key else layout.prompt_fallbacks,
        )

    def __post_init__(self) -> None:
        self._template = _compile(self.template_source) if self.template_source else None

    def prompt_field(self, row: dict) -> str:
        """The row field holding the prompt: prompt_key, else the first present fallback."""
        for key in (self.prompt_key, *self.prompt_fallbacks):
            if has_field(row, key):
                return key
        if self.prompt_fallbacks:
            raise KeyError(
                f"none of the prompt fields {[self.prompt_key, *self.prompt_fallbacks]} is present"
            )
        return get_field(row, self.prompt_key)  # raises KeyError naming the missing part

    def user_text(self, row: dict) -> str:
        """The user turn from a row's fields; KeyError names a missing field (row skipped)."""
        if self.prompt_template:
            question = self.prompt_template.format_map(_Fields(row))
        else:
            key = self.prompt_field(row)
            question = get_field(row, key)
            if not isinstance(question, str):
                raise TypeError(f"field {key!r} is {type(question).__name__}, not text")
        if not question.strip():
            raise ValueError("empty prompt")
        return f"{question}\n{self.instruction}" if self.instruction else question

    def render(self, user: str) -> str:
        """The exact prompt text for one user turn: chat template with the generation prompt, or
        the dataset's raw framing (with the system prompt as a leading paragraph)."""
        if self._template is None:
            framed = self.raw_frame.format(user=user)
            return f"{self.system_prompt}\n\n{framed}" if self.system_prompt else framed
        messages = [{"role": "user", "content": user}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self._template.render(messages=messages, add_generation_prompt=True, **self.specials)

    def message_texts(self, role: str, content: str) -> tuple[str, str]:
        """One more message after an assistant turn, as (closing, opening) text for multi-turn
        episodes (agent/context.py render_message):

            closing  what the template writes after an assistant message's content (ChatML:
                     "<|im_end|>\n"); the part the model already produced is dropped by the caller
            opening  the new message and the next assistant turn's generation prompt

        Both are differences of two renders of the same conversation (the template itself decides
        the markup, nothing is hard-coded per model). Raw text: no closing, "\n<content>\n"."""
        if self._template is None:
            return "", f"\n{content}\n"
        sentinel = "\x00ASSISTANT\x00"
        history = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": sentinel}]
        if self.system_prompt:
            history.insert(0, {"role": "system", "content": self.system_prompt})
        base = self._template.render(messages=history, add_generation_prompt=False, **self.specials)
        full = self._template.render(
            messages=[*history, {"role": role, "content": content}],
            add_generation_prompt=True,
            **self.specials,
        )
        if sentinel not in base or not full.startswith(base):
            raise ValueError(
                f"the chat template ({self.template_origin}) does not render a conversation as a prefix of "
                "its continuation; multi-turn workflows need one that does (data.chat_template=<file.jinja>)"
            )
        return base[base.rindex(sentinel) + len(sentinel) :], full[len(base) :]

    def render_row(self, row: dict) -> str:
        """A row's prompt: chat messages (verl's `prompt`, AReaL's `messages`) through the template
        as they are; text as a user turn (with the instruction)."""
        if not self.prompt_template:
            value = get_field(row, self.prompt_field(row))
            if isinstance(value, list):
                return self.render_messages(_messages(value))
        return self.render(self.user_text(row))

    def render_messages(self, messages: list[dict[str, str]]) -> str:
        """Chat messages as given, with the generation prompt; data.system_prompt is added only
        when they have no system turn. Raw text: the contents as paragraphs, framed."""
        if self.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        if self._template is None:
            *head, last = [m["content"] for m in messages]
            return "\n\n".join([*head, self.raw_frame.format(user=last)])
        return self._template.render(messages=messages, add_generation_prompt=True, **self.specials)

    def reference(self, row: dict) -> str:
        """What the reward compares against; KeyError/ValueError mark the row unusable."""
        for key in self.answer_keys:
            value = get_field(row, key) if has_field(row, key) else None
            if value not in (None, ""):
                answer = value if isinstance(value, str) else json.dumps(value)
                if self.dataset is Dataset.gsm8k and self.answer_keys == ("answer",):
                    if "####" not in answer:  # GSM8K's own layout: a solution ending "#### x"
                        raise ValueError("answer has no '#### <final answer>' line")
                    return answer.split("####")[-1].strip()
                if self.dataset is Dataset.file and key == "answer" and "####" in answer:
                    return answer.split("####")[-1].strip()  # AReaL's GSM8K rows
                return answer
        raise KeyError(f"none of the answer fields {list(self.answer_keys)} is present")

    def describe(self) -> str:
        return (
            f"data.chat_template={self.template_origin} data.system_prompt={self.system_prompt!r} "
            f"data.instruction={self.instruction!r}"
        )


def _messages(value: list) -> list[dict[str, str]]:
    """A list of {role, content} with text contents; TypeError/ValueError mark the row unusable."""
    if not value:
        raise ValueError("empty prompt (no messages)")
    out = []
    for m in value:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise TypeError("chat messages must be {role, content} objects with text content")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["content"].strip() for m in out):
        raise ValueError("empty prompt (messages without content)")
    return out


class _Fields(dict):
    """Row fields for str.format_map; a missing one raises KeyError naming it."""

    def __missing__(self, key: str) -> str:
        raise KeyError(f"prompt_template field {key!r} is not in the row")
