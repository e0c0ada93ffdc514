"""Which model and which prompts: the policy checkpoint and the datasets."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from areal_jobs.config.lora import LoraConfig


class Dataset(enum.Enum):
    arith = "arith"  # the built-in, code-generated multi-step arithmetic task
    countdown = (
        "countdown"  # the second built-in task: make a target from three digits (tasks/countdown_task.py)
    )
    gsm8k = "gsm8k"  # GSM8K-style JSONL: {"question", "answer"} with "#### <answer>"
    math = "math"  # MATH-style JSONL: {"problem", "solution"} with \boxed{...}
    humaneval = "humaneval"  # HumanEval JSONL: prompt + check(candidate) tests
    code_stdio = "code_stdio"  # JSONL: {"prompt", "tests": [{"input", "output"}]}
    # field-format files as verl and AReaL write them (data/records.py): the prompt from `prompt`
    # (text or chat messages), `messages`, `question` or `problem`; the answer from
    # `reward_model.ground_truth`, `ground_truth`, `answer` or `solution`; reward by `data_source`
    file = "file"


class DataFormat(enum.Enum):
    auto = "auto"  # by the path: .parquet, .json, .jsonl, a save_to_disk directory
    parquet = "parquet"
    json = "json"  # one JSON list of row objects (or JSON lines, as `datasets` reads it)
    jsonl = "jsonl"  # one JSON object per line
    hf_disk = "hf_disk"  # a directory written by datasets' save_to_disk (a Dataset or DatasetDict)


BUILTIN_DATASETS = (Dataset.arith, Dataset.countdown)  # generated in code: no train_path


class DType(enum.Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass
class ModelConfig:
    """Which policy to train: an HF directory (config.json + safetensors + tokenizer)."""

    path: str = ""  # HF model directory; empty = the built-in tiny model (built on first use)
    dtype: DType = DType.float32  # parameter dtype in trainer and rollout servers
    builtin_dir: str = (
        "areal_jobs/tasks/models/builtin_model"  # the committed warm start; another dir builds one
    )
    builtin_sft_steps: int = 2000  # phase-1 warm-start steps (a different value needs another builtin_dir)
    # the planner's memory check reads model.path's config.json; where that directory is not on the
    # submitting machine, a named shape stands in (launch/planning/fit/model_shape.py), e.g. qwen2_1p5b
    shape: str = ""
    lora: LoraConfig = field(default_factory=LoraConfig)  # model.lora.rank > 0: train adapters only

    def __post_init__(self) -> None:
        if self.builtin_sft_steps < 0:
            raise ValueError("model.builtin_sft_steps must be >= 0")


@dataclass
class SourceConfig:
    """One source of a mixture (data.sources): its rows, its share of the stream, its reward."""

    name: str = ""  # metrics source/<name>/..., eval/<name>/accuracy; the rows' data_source
    path: str = ""  # training rows (any data.format); "" for a built-in dataset
    weight: float = 1.0  # share of the stream (weights are normalised over the sources)
    dataset: Dataset = Dataset.file
    format: DataFormat = DataFormat.auto
    eval_path: str = ""  # held-out rows; "" = the tail of `path` (built-in: generated)
    num_eval_prompts: int = 64  # held-out prompts of this source
    prompt_key: str = ""  # as data.prompt_key, for this source
    answer_key: str = ""  # as data.answer_key, for this source
    instruction: str | None = None  # as data.instruction, for this source
    # a built-in verifier name (arith, gsm8k, math, ...), a function `file.py:fn` / `module:fn`,
    # or "" = the dataset's default (file: routed by each row's data_source, as verl does)
    reward: str = ""


def check_sources(sources: list[SourceConfig], window: int) -> None:
    """Errors name the override that fixes them (data.sources.<i>.<key>)."""
    names = [s.name for s in sources]
    for i, s in enumerate(sources):
        key = f"data.sources.{i}"
        if not s.name or "/" in s.name:
            raise ValueError(f"{key}.name must be a non-empty name without '/' (it keys the metrics)")
        if s.name in names[:i]:
            raise ValueError(f"{key}.name={s.name} is used twice: source names must be unique")
        if not s.weight > 0:
            raise ValueError(f"{key}.weight={s.weight} must be > 0 (drop the source to leave it out)")
        if s.dataset in BUILTIN_DATASETS and s.path:
            raise ValueError(f"{key}.dataset={s.dataset.value} is generated in code: drop {key}.path")
        if s.dataset not in BUILTIN_DATASETS and not s.path:
            raise ValueError(f"{key}.path is empty: set it to the source's rows (or {key}.dataset=arith)")
        if s.num_eval_prompts < 0:
            raise ValueError(f"{key}.num_eval_prompts must be >= 0")
    if window < 0:
        raise ValueError("data.mixture_window must be >= 0 (0 = the smallest window with exact weights)")


@dataclass
class DataConfig:
    """Prompts for training and held-out evaluation."""

    # arith/countdown: built-in tasks; gsm8k/math/humaneval/code_stdio: those JSONL shapes; file:
    # verl's and AReaL's field formats. A data.train_path with the default (arith) reads as `file`
    dataset: Dataset = Dataset.arith
    train_path: str = ""  # Parquet, JSON, JSONL or a save_to_disk directory; unused for built-in tasks
    eval_path: str = ""  # held-out rows (same formats); empty = split from train / generated
    format: DataFormat = DataFormat.auto  # how train_path/eval_path are read; auto = by the path
    num_eval_prompts: int = 256  # held-out prompts scored at start, every eval interval, and end
    max_prompt_tokens: int = 512  # longer prompts are skipped and counted (file and line reported)
    seed: int = 1  # prompt order; the same seed replays the same prompt sequence after resume
    # how a row becomes the prompt (areal_jobs/data/chat.py): "auto" = the tokenizer's chat template
    # with the generation prompt (raw text when it has none), "none" = raw text, or a .jinja file
    chat_template: str = "auto"
    system_prompt: str = ""  # a system turn (raw text: a leading paragraph); "" = none
    instruction: str | None = None  # appended to the user turn; null = the dataset's default
    # row field with the question (dots reach nested fields); "" = the dataset's (question, problem,
    # prompt, messages); a list of {role, content} goes through the chat template as it is
    prompt_key: str = ""
    # row field with the reference, e.g. reward_model.ground_truth; "" = the dataset's
    answer_key: str = ""
    prompt_template: str = ""  # str.format over the row's fields, e.g. "{problem}\n{choices}"

    # a mixture (data/mixture.py): several sources, each with its weight and reward; when set,
    # train_path/eval_path/dataset above are unused (conf/experiment/mixture_local.yaml shows one)
    sources: list[SourceConfig] = field(default_factory=list)
    mixture_window: int = 0  # positions over which the weights hold exactly; 0 = the smallest exact one

    def __post_init__(self) -> None:
        if self.sources:
            check_sources(self.sources, self.mixture_window)
            return
        if self.dataset is Dataset.arith and self.train_path:
            # a verl/AReaL user's first command is data.train_path=<file>: read it, don't ignore it
            self.dataset = Dataset.file
        if self.dataset not in BUILTIN_DATASETS and not self.train_path:
            raise ValueError(f"data.dataset={self.dataset.value} needs data.train_path=<file>")
        if self.dataset in BUILTIN_DATASETS and self.train_path:
            raise ValueError(
                f"data.dataset={self.dataset.value} is generated in code and reads no file: "
                "drop data.train_path or set data.dataset=file"
            )
        if self.num_eval_prompts < 0:
            raise ValueError("data.num_eval_prompts must be >= 0")
        if not self.chat_template:
            raise ValueError("data.chat_template must be auto, none or a path to a Jinja template")
        if self.prompt_template and self.prompt_key:
            raise ValueError("set data.prompt_template or data.prompt_key, not both")
