"""Prompt streams: the deterministic, resumable sequence of prompts the controller admits.

A stream is a pure function of (dataset, seed, position): `PromptStream.at(i)` is the i-th prompt,
so a checkpoint only stores the position, and a resumed run admits exactly the prompts an
uninterrupted run would. File datasets are read once (data/records.py: bad rows are skipped and
counted with file and line), and each epoch visits the rows in a fresh seeded order. A mixture
(data.sources) interleaves several such streams (data/mixture.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from areal_jobs.config import DataConfig, Dataset
from areal_jobs.data.chat import PromptFormat
from areal_jobs.data.mixture import (
    EVAL_INDEX_STRIDE,
    MixtureStream,
    check_reward,
    source_config,
    window_counts,
)
from areal_jobs.data.records import REWARD_TASK, Encode, LoadReport, Row, load_rows
from areal_jobs.tasks import arith_task, countdown_task

__all__ = ["REWARD_TASK", "Encode", "LoadReport", "Prompt", "PromptSet", "PromptStream", "Row",
           "eval_prompts", "file_prompt", "load_prompts", "load_rows"]  # fmt: skip

Render = Callable[[str], str]


@dataclass(frozen=True)
class Prompt:
    data_index: int  # position in the stream
    input_ids: list[int]
    reward_task: str  # reward registry name (or a function spec `file.py:fn`)
    reference: str  # what the reward function compares against
    bucket: str = ""  # evaluation reports accuracy per bucket (built-in task: chain length); "" = none
    data_source: str = ""  # which source the row came from (verl's `data_source`; a mixture's name)
    extra_info: str = "{}"  # JSON object: the row's other fields, passed to the reward function
    source: str = ""  # per-source metrics key (source/<name>/...): a mixture's source, else data_source


def file_prompt(index: int, row: Row, encode: Encode, reward_task: str, source: str = "") -> Prompt:
    """A file row as the prompt at `index`; `reward_task` "" = the row's routed reward (or the
    dataset's); `source` "" = the row's data_source."""
    data_source = row.data_source or source
    return Prompt(index, encode(row.text), reward_task or row.reward_task, row.reference, "",
                  data_source, row.extra_info, source or row.data_source)  # fmt: skip


class PromptStream:
    """Deterministic prompts by position; `next()` advances, `position` is checkpointed."""

    def __init__(
        self,
        cfg: DataConfig,
        encode: Encode,
        rows: list[Row] | None = None,
        render: Render = str,
        reward_task: str = "",
        source: str = "",
    ) -> None:
        self.cfg = cfg
        self.encode = encode
        self.render = render  # the built-in task's text -> the prompt (PromptFormat.render)
        self.rows = rows
        self.reward_task = reward_task  # overrides the dataset's (reward.function, a source's reward)
        self.source = source  # a mixture source's name; "" = a single dataset
        self.position = 0
        self._epoch_orders: dict[int, list[int]] = {}

    def at(self, index: int) -> Prompt:
        task, name = self.reward_task, self.source
        if self.cfg.dataset is Dataset.arith:
            problem = arith_task.problem_at(self.cfg.seed, index)
            ids = self.encode(self.render(problem.prompt))
            return Prompt(index, ids, task or "arith", str(problem.answer), "", name, "{}", name)
        if self.cfg.dataset is Dataset.countdown:
            problem = countdown_task.problem_at(self.cfg.seed, index)
            ids = self.encode(self.render(problem.prompt))
            return Prompt(index, ids, task or "countdown", problem.reference, "", name, "{}", name)
        assert self.rows, "file datasets need rows"
        epoch, offset = divmod(index, len(self.rows))
        if epoch not in self._epoch_orders:
            order = list(range(len(self.rows)))
            random.Random(self.cfg.seed * 7919 + epoch).shuffle(order)
            self._epoch_orders = {epoch: order}  # only the current epoch is kept in memory
        row = self.rows[self._epoch_orders[epoch][offset]]
        return file_prompt(
            index, row, self.encode, self.reward_task or _default_task(self.cfg.dataset, row), name
        )

    def next(self) -> Prompt:
        prompt = self.at(self.position)
        self.position += 1
        return prompt


def eval_prompts(
    cfg: DataConfig,
    encode: Encode,
    rows: list[Row] | None = None,
    render: Render = str,
    reward_task: str = "",
    source: str = "",
    first_index: int = -1,
) -> list[Prompt]:
    """The held-out set: generated from a disjoint seed (the built-in tasks) or the eval file's
    first rows. Indices count down from `first_index` (never a training position)."""
    task, name = reward_task, source
    if cfg.dataset is Dataset.arith:
        out = []
        for i in range(cfg.num_eval_prompts):
            problem = arith_task.eval_problem_at(cfg.seed, i)
            bucket = arith_task.length_bucket(problem.num_steps)
            ids = encode(render(problem.prompt))
            out.append(
                Prompt(first_index - i, ids, task or "arith", str(problem.answer), bucket, name, "{}", name)
            )
        return out
    if cfg.dataset is Dataset.countdown:
        problems = [countdown_task.eval_problem_at(cfg.seed, i) for i in range(cfg.num_eval_prompts)]
        return [
            Prompt(
                first_index - i,
                encode(render(p.prompt)),
                task or "countdown",
                p.reference,
                "",
                name,
                "{}",
                name,
            )
            for i, p in enumerate(problems)
        ]
    if not rows:
        return []
    return [
        file_prompt(first_index - i, row, encode, task or _default_task(cfg.dataset, row), name)
        for i, row in enumerate(rows[: cfg.num_eval_prompts])
    ]


def _default_task(dataset: Dataset, row: Row) -> str:
    """The reward when none is configured: the row's routed one (data.dataset=file), else the
    dataset's verifier."""
    return row.reward_task or REWARD_TASK[dataset]


@dataclass
class PromptSet:
    """Everything a process needs to prompt the policy, built by `load_prompts`."""

    format: PromptFormat
    stream: PromptStream | MixtureStream  # training prompts by position
    held_out: list[Prompt]  # scored at start, every eval interval and at the end
    first_prompt: str  # the resolved text of the first training prompt (printed at start-up)


def load_prompts(data: DataConfig, model_dir: str, encode: Encode, reward_function: str = "") -> PromptSet:
    """The one place prompts are built (training, periodic evaluation, launch.evaluate).

    The held-out set is data.eval_path, else the tail of the training file (file datasets), else
    generated from a disjoint seed (the built-in task). `reward_function` (reward.function) scores
    every prompt of a single dataset; "" = the dataset's verifier. data.sources: a mixture."""
    if data.sources:
        return load_mixture(data, model_dir, encode)
    fmt = PromptFormat.load(data, model_dir)
    stream, held_out = load_source(data, fmt, encode, reward_function)
    first = stream.rows[0].text if stream.rows else _first_builtin_prompt(data, fmt)
    return PromptSet(fmt, stream, held_out, first)


def load_source(
    data: DataConfig,
    fmt: PromptFormat,
    encode: Encode,
    reward_task: str = "",
    source: str = "",
    key: str = "data",
    first_index: int = -1,
) -> tuple[PromptStream, list[Prompt]]:
    """One dataset's training stream and held-out prompts; `key` names its settings in errors
    (data, or data.sources.<i> with path for train_path)."""
    train_key = f"{key}.train_path" if key == "data" else f"{key}.path"
    rows = held_out = None
    if data.train_path:
        rows, _ = load_rows(fmt, data.train_path, encode, data.max_prompt_tokens, data.format, train_key)
    if data.eval_path:
        held_out, _ = load_rows(
            fmt, data.eval_path, encode, data.max_prompt_tokens, data.format, f"{key}.eval_path"
        )
    elif rows is not None:  # hold out the tail of the training file
        if len(rows) <= data.num_eval_prompts:
            raise ValueError(
                f"{data.train_path} has {len(rows)} usable rows, not more than {key}.num_eval_prompts="
                f"{data.num_eval_prompts}: set {key}.eval_path or lower {key}.num_eval_prompts"
            )
        rows, held_out = rows[: -data.num_eval_prompts or None], rows[len(rows) - data.num_eval_prompts :]
    stream = PromptStream(data, encode, rows, fmt.render, reward_task, source)
    return stream, eval_prompts(data, encode, held_out, fmt.render, reward_task, source, first_index)


def load_mixture(data: DataConfig, model_dir: str, encode: Encode) -> PromptSet:
    """data.sources -> one interleaved stream and every source's held-out prompts, in order."""
    streams, held_out, names, first = [], [], [], ""
    fmt = None
    for i, source in enumerate(data.sources):
        key = f"data.sources.{i}"
        check_reward(source.reward, key)
        cfg = source_config(data, source, i)
        source_fmt = PromptFormat.load(cfg, model_dir)
        fmt = fmt or source_fmt
        stream, prompts = load_source(
            cfg, source_fmt, encode, source.reward, source.name, key, -1 - i * EVAL_INDEX_STRIDE
        )
        streams.append(stream)
        held_out.extend(prompts)
        names.append(source.name)
        if not first:
            first = stream.rows[0].text if stream.rows else _first_builtin_prompt(cfg, source_fmt)
    counts = window_counts([s.weight for s in data.sources], data.mixture_window)
    assert fmt is not None
    return PromptSet(fmt, MixtureStream(streams, names, counts), held_out, first)


def _first_builtin_prompt(data: DataConfig, fmt: PromptFormat) -> str:
    task = countdown_task if data.dataset is Dataset.countdown else arith_task
    return fmt.render(task.problem_at(data.seed, 0).prompt)


def describe_first_prompt(prompts: PromptSet) -> str:
    """The start-up line: the format settings and the first prompt exactly as the model gets it."""
    return f"prompt format: {prompts.format.describe()}\nfirst prompt:\n{prompts.first_prompt}"
