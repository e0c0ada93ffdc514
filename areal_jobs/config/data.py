"""Which model and which prompts: the policy checkpoint and the datasets."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from areal_jobs.config.lora import LoraConfig


class Dataset(enum.Enum):
    arith = "arith"  # the built-in, code-generated multi-step arithmetic task
    countdown = (
        "countdown"  # the second built-in task: make a target from three digits (data/countdown_task.py)
    )
    gsm8k = "gsm8k"  # GSM8K-style JSONL: {"question", "answer"} with "#### <answer>"
    math = "math"  # MATH-style JSONL: {"problem", "solution"} with \boxed{...}
    humaneval = "humaneval"  # HumanEval JSONL: prompt + check(candidate) tests
    code_stdio = "code_stdio"  # JSONL: {"prompt", "tests": [{"input", "output"}]}


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
    builtin_dir: str = "areal_jobs/data/builtin_model"  # the committed warm start; another dir builds one
    builtin_sft_steps: int = 2000  # phase-1 warm-start steps (a different value needs another builtin_dir)
    # the planner's memory check reads model.path's config.json; where that directory is not on the
    # submitting machine, a named shape stands in (launch/planning/model_shape.py), e.g. qwen2_1p5b
    shape: str = ""
    lora: LoraConfig = field(default_factory=LoraConfig)  # model.lora.rank > 0: train adapters only

    def __post_init__(self) -> None:
        if self.builtin_sft_steps < 0:
            raise ValueError("model.builtin_sft_steps must be >= 0")


@dataclass
class DataConfig:
    """Prompts for training and held-out evaluation."""

    dataset: Dataset = Dataset.arith
    train_path: str = ""  # JSONL for file datasets; unused for the built-in task
    eval_path: str = ""  # held-out JSONL; empty = split from train (file datasets) / generated
    num_eval_prompts: int = 256  # held-out prompts scored at start, every eval interval, and end
    max_prompt_tokens: int = 512  # longer prompts are skipped and counted (file and line reported)
    seed: int = 1  # prompt order; the same seed replays the same prompt sequence after resume
    # how a row becomes the prompt (areal_jobs/data/chat.py): "auto" = the tokenizer's chat template
    # with the generation prompt (raw text when it has none), "none" = raw text, or a .jinja file
    chat_template: str = "auto"
    system_prompt: str = ""  # a system turn (raw text: a leading paragraph); "" = none
    instruction: str | None = None  # appended to the user turn; null = the dataset's default
    prompt_key: str = ""  # row field with the question; "" = the dataset's (question, problem, prompt)
    answer_key: str = ""  # row field with the reference; "" = the dataset's (answer, then solution)
    prompt_template: str = ""  # str.format over the row's fields, e.g. "{problem}\n{choices}"

    def __post_init__(self) -> None:
        if self.dataset not in BUILTIN_DATASETS and not self.train_path:
            raise ValueError(f"data.dataset={self.dataset.value} needs data.train_path=<file.jsonl>")
        if self.num_eval_prompts < 0:
            raise ValueError("data.num_eval_prompts must be >= 0")
        if not self.chat_template:
            raise ValueError("data.chat_template must be auto, none or a path to a Jinja template")
        if self.prompt_template and self.prompt_key:
            raise ValueError("set data.prompt_template or data.prompt_key, not both")
