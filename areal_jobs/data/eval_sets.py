"""Evaluation sets: the problems `launch.evaluate` asks a checkpoint, as prompts for the reward
functions training uses.

    builtin      the built-in task's held-out problems (the same ones a run evaluates)
    countdown    the countdown task's held-out problems (tasks/countdown_task.py; the same ones
                 a run with data.dataset=countdown evaluates)
    gsm8k        {"question", "answer"}, the gold answer after "#### "
    math         one problem field and one answer field, names configurable: MATH-500
                 {"problem", "answer"}, AIME/AMC layouts ({"Problem", "Answer"}, {"question", ...});
                 the answer may be plain ("204") or a solution that marks it with \\boxed{}
    humaneval    {"prompt", "test", "entry_point"}: the completion runs against check(candidate)
    code_stdio   {"prompt", "tests": [{"input", "output"}]}

Prompts are formatted exactly as for training (data/prompts.py), so a checkpoint trained on a set
is asked in the form it learned. Unusable rows are skipped and reported with file and line.
"""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import dataclass

from areal_jobs.config import DataConfig, Dataset
from areal_jobs.data.chat import PromptFormat
from areal_jobs.data.prompts import REWARD_TASK, Encode, LoadReport, Prompt, eval_prompts, load_rows

logger = logging.getLogger(__name__)


class EvalSet(enum.Enum):
    builtin = "builtin"
    countdown = "countdown"
    gsm8k = "gsm8k"
    math = "math"
    humaneval = "humaneval"
    code_stdio = "code_stdio"


GENERATED = (EvalSet.builtin, EvalSet.countdown)  # generated in code, no file
_DATASET = {EvalSet.builtin: Dataset.arith, EvalSet.countdown: Dataset.countdown}


@dataclass(frozen=True)
class EvalSetSpec:
    kind: EvalSet
    path: str = ""  # JSONL; unused for builtin
    problem_field: str = "problem"  # math only
    answer_field: str = "answer"  # math only
    limit: int = 0  # the first `limit` usable problems; 0 = all (builtin, countdown: 256)
    seed: int = 1  # builtin, countdown: the run's data.seed picks its held-out problems

    def __post_init__(self) -> None:
        if self.kind not in GENERATED and not self.path:
            raise ValueError(f"the {self.kind.value} evaluation set needs a JSONL path")
        if self.limit < 0:
            raise ValueError("limit must be >= 0 (0 = every problem)")


def detect_kind(path: str) -> EvalSet:
    """The layout of a JSONL file from the keys of its first row."""
    with open(path, encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    if not first:
        raise ValueError(f"{path} is empty")
    keys = set(json.loads(first))
    if {"prompt", "test", "entry_point"} <= keys:
        return EvalSet.humaneval
    if {"prompt", "tests"} <= keys:
        return EvalSet.code_stdio
    if {"question", "answer"} <= keys and "####" in str(json.loads(first)["answer"]):
        return EvalSet.gsm8k
    return EvalSet.math


def read_eval_set(
    spec: EvalSetSpec,
    encode: Encode,
    max_prompt_tokens: int,
    model_dir: str = "",
    chat_template: str = "auto",
    instruction: str | None = None,
) -> tuple[list[Prompt], LoadReport]:
    """The set's prompts (data_index -1, -2, ...: never a training position) and what was skipped.

    Prompts are built like training's (data/chat.py PromptFormat: the checkpoint's chat template
    under `auto`, the dataset's default instruction unless `instruction` is given)."""
    dataset = _DATASET.get(spec.kind) or Dataset(spec.kind.value)
    data = DataConfig(
        dataset=dataset,
        train_path=spec.path,
        seed=spec.seed,
        num_eval_prompts=spec.limit or 256,
        chat_template=chat_template,
        instruction=instruction,
        prompt_key=spec.problem_field if spec.kind is EvalSet.math else "",
        answer_key=spec.answer_field if spec.kind is EvalSet.math else "",
    )
    fmt = PromptFormat.load(data, model_dir)
    if spec.kind in GENERATED:
        prompts = eval_prompts(data, encode, None, fmt.render)
        return prompts, LoadReport(num_rows=len(prompts))
    rows, report = load_rows(fmt, spec.path, encode, max_prompt_tokens)
    if not rows:
        raise ValueError(f"no usable rows in {spec.path}: check the problem/answer field names")
    task = REWARD_TASK[dataset]
    prompts = [Prompt(-1 - i, encode(r.text), task, r.reference) for i, r in enumerate(rows)]
    return (prompts[: spec.limit] if spec.limit else prompts), report
