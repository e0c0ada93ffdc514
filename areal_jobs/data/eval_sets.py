"""Evaluation sets: the problems `launch.evaluate` asks a checkpoint, as prompts for the reward
functions training uses.

    builtin      the built-in task's held-out problems (the same ones a run evaluates)
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
from areal_jobs.data.prompts import Encode, LoadReport, Prompt, eval_prompts, load_rows

logger = logging.getLogger(__name__)


class EvalSet(enum.Enum):
    builtin = "builtin"
    gsm8k = "gsm8k"
    math = "math"
    humaneval = "humaneval"
    code_stdio = "code_stdio"


MATH_PROMPT = "Problem: {problem}\nSolution:"  # the training prompt of data.dataset=math


@dataclass(frozen=True)
class EvalSetSpec:
    kind: EvalSet
    path: str = ""  # JSONL; unused for builtin
    problem_field: str = "problem"  # math only
    answer_field: str = "answer"  # math only
    limit: int = 0  # the first `limit` usable problems; 0 = all (builtin: 256)
    seed: int = 1  # builtin: the run's data.seed picks its held-out problems

    def __post_init__(self) -> None:
        if self.kind is not EvalSet.builtin and not self.path:
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
    spec: EvalSetSpec, encode: Encode, max_prompt_tokens: int
) -> tuple[list[Prompt], LoadReport]:
    """The set's prompts (data_index -1, -2, ...: never a training position) and what was skipped."""
    if spec.kind is EvalSet.builtin:
        cfg = DataConfig(dataset=Dataset.arith, seed=spec.seed, num_eval_prompts=spec.limit or 256)
        prompts = eval_prompts(cfg, encode)
        return prompts, LoadReport(num_rows=len(prompts))
    if spec.kind is EvalSet.math:
        prompts, report = _read_math(spec, encode, max_prompt_tokens)
    else:
        dataset = Dataset(spec.kind.value)
        rows, report = load_rows(dataset, spec.path, encode, max_prompt_tokens)
        task = dataset.value  # the reward registry names match the dataset names
        prompts = [Prompt(-1 - i, encode(r.text), task, r.reference) for i, r in enumerate(rows)]
    return (prompts[: spec.limit] if spec.limit else prompts), report


def _read_math(spec: EvalSetSpec, encode: Encode, max_prompt_tokens: int) -> tuple[list[Prompt], LoadReport]:
    prompts, report = [], LoadReport()
    with open(spec.path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            report.num_rows += 1
            where = f"{spec.path}:{lineno}"
            try:
                obj = json.loads(line)
                problem, answer = obj[spec.problem_field], obj[spec.answer_field]
            except json.JSONDecodeError as exc:
                report.skipped.append(f"{where}: not JSON: {exc}")
                continue
            except KeyError as exc:
                report.skipped.append(f"{where}: no field {exc} (set the problem/answer field names)")
                continue
            if not isinstance(problem, str) or answer is None or str(answer).strip() == "":
                report.skipped.append(f"{where}: empty problem or answer")
                continue
            ids = encode(MATH_PROMPT.format(problem=problem))
            if len(ids) > max_prompt_tokens:
                report.skipped.append(f"{where}: prompt longer than {max_prompt_tokens} tokens")
                continue
            prompts.append(Prompt(-1 - len(prompts), ids, "math", str(answer).strip()))
    for entry in report.skipped[:20]:
        logger.warning("skipped row %s", entry)
    if not prompts:
        raise ValueError(f"no usable rows in {spec.path}: check the problem/answer field names")
    return prompts, report
