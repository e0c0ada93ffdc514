"""Prompt streams: the deterministic, resumable sequence of prompts the controller admits.

A stream is a pure function of (dataset, seed, position): `PromptStream.at(i)` is the i-th prompt,
so a checkpoint only stores the position, and a resumed run admits exactly the prompts an
uninterrupted run would. File datasets are read once, bad rows are skipped and counted with
file and line, and each epoch visits the rows in a fresh seeded order.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from areal_jobs.config import DataConfig, Dataset
from areal_jobs.config.data import BUILTIN_DATASETS
from areal_jobs.data import arith_task, countdown_task
from areal_jobs.data.chat import PromptFormat

logger = logging.getLogger(__name__)

Encode = Callable[[str], list[int]]
Render = Callable[[str], str]


@dataclass(frozen=True)
class Prompt:
    data_index: int  # position in the stream
    input_ids: list[int]
    reward_task: str  # reward registry name
    reference: str  # what the reward function compares against
    bucket: str = ""  # evaluation reports accuracy per bucket (built-in task: chain length); "" = none


@dataclass
class Row:
    text: str  # the rendered prompt, exactly as tokenized and sent
    reference: str


@dataclass
class LoadReport:
    """Rows that could not be used, with where they are: nothing is dropped silently."""

    num_rows: int = 0
    skipped: list[str] = field(default_factory=list)  # "file:line: why"


REWARD_TASK = {
    Dataset.arith: "arith",
    Dataset.countdown: "countdown",
    Dataset.gsm8k: "gsm8k",
    Dataset.math: "math",
    Dataset.humaneval: "humaneval",
    Dataset.code_stdio: "code_stdio",
}


def _row_from_json(fmt: PromptFormat, obj: dict) -> Row:
    if not isinstance(obj, dict):
        raise TypeError(f"a row must be a JSON object, got {type(obj).__name__}")
    if fmt.dataset is Dataset.humaneval:
        ref = {"prompt": obj["prompt"], "test": obj["test"], "entry_point": obj["entry_point"]}
        return Row(fmt.render_row(obj), json.dumps(ref))
    if fmt.dataset is Dataset.code_stdio:
        tests = obj["tests"]
        if not isinstance(tests, list) or not tests:
            raise ValueError("'tests' must be a non-empty list of {input, output}")
        return Row(fmt.render_row(obj), json.dumps({"tests": tests}))
    if fmt.dataset in BUILTIN_DATASETS:
        raise ValueError("the built-in tasks have no file rows")
    return Row(fmt.render_row(obj), fmt.reference(obj))


def load_rows(
    fmt: PromptFormat, path: str, encode: Encode, max_prompt_tokens: int
) -> tuple[list[Row], LoadReport]:
    """Every usable row of a JSONL file, its prompt already rendered by `fmt` (what is sent)."""
    rows, report = [], LoadReport()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            report.num_rows += 1
            try:
                row = _row_from_json(fmt, json.loads(line))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                report.skipped.append(f"{path}:{lineno}: {type(exc).__name__}: {exc}")
                continue
            if len(encode(row.text)) > max_prompt_tokens:
                report.skipped.append(
                    f"{path}:{lineno}: prompt longer than data.max_prompt_tokens={max_prompt_tokens}"
                )
                continue
            rows.append(row)
    for entry in report.skipped[:20]:
        logger.warning("skipped row %s", entry)
    if report.skipped:
        logger.warning("skipped %d of %d rows in %s", len(report.skipped), report.num_rows, path)
    if not rows:
        raise ValueError(f"no usable rows in {path}: fix the file or point data.train_path elsewhere")
    return rows, report


class PromptStream:
    """Deterministic prompts by position; `next()` advances, `position` is checkpointed."""

    def __init__(
        self, cfg: DataConfig, encode: Encode, rows: list[Row] | None = None, render: Render = str
    ) -> None:
        self.cfg = cfg
        self.encode = encode
        self.render = render  # the built-in task's text -> the prompt (PromptFormat.render)
        self.rows = rows
        self.position = 0
        self._epoch_orders: dict[int, list[int]] = {}

    def at(self, index: int) -> Prompt:
        if self.cfg.dataset is Dataset.arith:
            problem = arith_task.problem_at(self.cfg.seed, index)
            return Prompt(index, self.encode(self.render(problem.prompt)), "arith", str(problem.answer))
        if self.cfg.dataset is Dataset.countdown:
            problem = countdown_task.problem_at(self.cfg.seed, index)
            return Prompt(index, self.encode(self.render(problem.prompt)), "countdown", problem.reference)
        assert self.rows, "file datasets need rows"
        epoch, offset = divmod(index, len(self.rows))
        if epoch not in self._epoch_orders:
            order = list(range(len(self.rows)))
            random.Random(self.cfg.seed * 7919 + epoch).shuffle(order)
            self._epoch_orders = {epoch: order}  # only the current epoch is kept in memory
        row = self.rows[self._epoch_orders[epoch][offset]]
        return Prompt(index, self.encode(row.text), REWARD_TASK[self.cfg.dataset], row.reference)

    def next(self) -> Prompt:
        prompt = self.at(self.position)
        self.position += 1
        return prompt


def eval_prompts(
    cfg: DataConfig, encode: Encode, rows: list[Row] | None = None, render: Render = str
) -> list[Prompt]:
    """The held-out set: generated from a disjoint seed (the built-in tasks) or the eval file's
    first rows."""
    if cfg.dataset is Dataset.arith:
        out = []
        for i in range(cfg.num_eval_prompts):
            problem = arith_task.eval_problem_at(cfg.seed, i)
            bucket = arith_task.length_bucket(problem.num_steps)
            out.append(Prompt(-1 - i, encode(render(problem.prompt)), "arith", str(problem.answer), bucket))
        return out
    if cfg.dataset is Dataset.countdown:
        problems = [countdown_task.eval_problem_at(cfg.seed, i) for i in range(cfg.num_eval_prompts)]
        return [
            Prompt(-1 - i, encode(render(p.prompt)), "countdown", p.reference) for i, p in enumerate(problems)
        ]
    if not rows:
        return []
    return [
        Prompt(-1 - i, encode(row.text), REWARD_TASK[cfg.dataset], row.reference)
        for i, row in enumerate(rows[: cfg.num_eval_prompts])
    ]


@dataclass
class PromptSet:
    """Everything a process needs to prompt the policy, built by `load_prompts`."""

    format: PromptFormat
    stream: PromptStream  # training prompts by position
    held_out: list[Prompt]  # scored at start, every eval interval and at the end
    first_prompt: str  # the resolved text of the first training prompt (printed at start-up)


def load_prompts(data: DataConfig, model_dir: str, encode: Encode) -> PromptSet:
    """The one place prompts are built (training, periodic evaluation, launch.evaluate).

    The held-out set is data.eval_path, else the tail of the training file (file datasets), else
    generated from a disjoint seed (the built-in task).
    """
    fmt = PromptFormat.load(data, model_dir)
    rows = held_out = None
    if data.train_path:
        rows, _ = load_rows(fmt, data.train_path, encode, data.max_prompt_tokens)
    if data.eval_path:
        held_out, _ = load_rows(fmt, data.eval_path, encode, data.max_prompt_tokens)
    elif rows is not None:  # hold out the tail of the training file
        if len(rows) <= data.num_eval_prompts:
            raise ValueError(
                f"{data.train_path} has {len(rows)} usable rows, not more than data.num_eval_prompts="
                f"{data.num_eval_prompts}: set data.eval_path or lower data.num_eval_prompts"
            )
        rows, held_out = rows[: -data.num_eval_prompts or None], rows[len(rows) - data.num_eval_prompts :]
    stream = PromptStream(data, encode, rows, fmt.render)
    first = rows[0].text if rows else _first_builtin_prompt(data, fmt)
    return PromptSet(fmt, stream, eval_prompts(data, encode, held_out, fmt.render), first)


def _first_builtin_prompt(data: DataConfig, fmt: PromptFormat) -> str:
    task = countdown_task if data.dataset is Dataset.countdown else arith_task
    return fmt.render(task.problem_at(data.seed, 0).prompt)


def describe_first_prompt(prompts: PromptSet) -> str:
    """The start-up line: the format settings and the first prompt exactly as the model gets it."""
    return f"prompt format: {prompts.format.describe()}\nfirst prompt:\n{prompts.first_prompt}"
