"""Dataset rows -> the prompts' text, reference, reward and the fields that travel with them.

    file (data/formats.py) ─▶ row dict ─▶ Row(text, reference, data_source, extra_info, reward_task)

A bad row (a missing field, a nested one included; an empty prompt; a prompt over
data.max_prompt_tokens; a line that is not JSON) is skipped and counted with `file:line` or
`file:row N` and the reason; a file with no usable row is refused with the first reasons.

The reward of a field-format row (data.dataset=file) follows verl's routing by `data_source`:
a built-in verifier's own name (arith, gsm8k, math, ...), a name with "gsm8k" in it -> gsm8k,
anything else -> math (a \\boxed{} answer compared with the reference, as verl's math recipes).
A configured reward (reward.function, a mixture source's `reward`) overrides the routing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from areal_jobs.config import DataFormat, Dataset
from areal_jobs.config.data import BUILTIN_DATASETS
from areal_jobs.data.chat import PromptFormat
from areal_jobs.data.formats import BadRow, plain, read_records
from areal_jobs.reward.registry import REWARD_TARGETS

logger = logging.getLogger(__name__)

Encode = Callable[[str], list[int]]

REWARD_TASK = {
    Dataset.arith: "arith",
    Dataset.countdown: "countdown",
    Dataset.gsm8k: "gsm8k",
    Dataset.math: "math",
    Dataset.humaneval: "humaneval",
    Dataset.code_stdio: "code_stdio",
    Dataset.file: "math",  # rows without a data_source the routing knows
}
_NOT_REWARDS = ("tool_python",)
MAX_REPORTED = 5  # reasons named in the error for a file with no usable row


@dataclass
class Row:
    text: str  # the rendered prompt, exactly as tokenized and sent
    reference: str
    data_source: str = ""  # the row's data_source (verl), "" when it has none
    extra_info: str = "{}"  # JSON: the row's other fields, for the reward function
    reward_task: str = ""  # the routed reward; "" = the dataset's default


@dataclass
class LoadReport:
    """Rows that could not be used, with where they are: nothing is dropped silently."""

    num_rows: int = 0
    skipped: list[str] = field(default_factory=list)  # "file:line: why"


def route_reward(data_source: str) -> str:
    """verl's default_compute_score routing, onto our verifiers."""
    if data_source in REWARD_TARGETS and data_source not in _NOT_REWARDS:
        return data_source
    if "gsm8k" in data_source.lower():
        return "gsm8k"
    return REWARD_TASK[Dataset.file]


def _extra_info(fmt: PromptFormat, obj: dict, prompt_key: str) -> str:
    """The row's fields other than the prompt (and a top-level answer), with verl's `extra_info`
    object merged on top: what a verl reward function reads as extra_info, and more."""
    answer_top = {k for k in fmt.answer_keys if "." not in k}
    extra = {
        k: v
        for k, v in obj.items()
        if k not in (prompt_key, "data_source", "extra_info") and k not in answer_top
    }
    if isinstance(obj.get("extra_info"), dict):
        extra.update(obj["extra_info"])
    return json.dumps(plain(extra))


def row_from_obj(fmt: PromptFormat, obj: dict) -> Row:
    """One row; KeyError/TypeError/ValueError say why it is unusable."""
    if isinstance(obj, BadRow):
        raise obj
    if not isinstance(obj, dict):
        raise TypeError(f"a row must be an object, got {type(obj).__name__}")
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
    text, reference = fmt.render_row(obj), fmt.reference(obj)
    if fmt.dataset is not Dataset.file:
        return Row(text, reference)
    source = obj.get("data_source")
    source = source if isinstance(source, str) else ""
    prompt_key = "" if fmt.prompt_template else fmt.prompt_field(obj)
    return Row(text, reference, source, _extra_info(fmt, obj, prompt_key.split(".")[0]), route_reward(source))


def load_rows(
    fmt: PromptFormat,
    path: str,
    encode: Encode,
    max_prompt_tokens: int,
    file_format: DataFormat = DataFormat.auto,
    key: str = "data.train_path",
) -> tuple[list[Row], LoadReport]:
    """Every usable row of the file, its prompt already rendered by `fmt` (what is sent)."""
    rows, report = [], LoadReport()
    for where, obj in read_records(path, file_format, key):
        report.num_rows += 1
        try:
            row = row_from_obj(fmt, obj)
        except (KeyError, TypeError, ValueError) as exc:
            report.skipped.append(f"{where}: {type(exc).__name__}: {exc}")
            continue
        if len(encode(row.text)) > max_prompt_tokens:
            report.skipped.append(f"{where}: prompt longer than data.max_prompt_tokens={max_prompt_tokens}")
            continue
        rows.append(row)
    for entry in report.skipped[:20]:
        logger.warning("skipped row %s", entry)
    if report.skipped:
        logger.warning("skipped %d of %d rows in %s", len(report.skipped), report.num_rows, path)
    if not rows:
        first = "; ".join(report.skipped[:MAX_REPORTED]) or "the file has no rows"
        raise ValueError(
            f"no usable rows in {path} (first reasons: {first}): fix the file or point {key} elsewhere"
        )
    return rows, report
