"""Reward models: a scorer served on its own rollout-engine servers (reward.model.*).

Two kinds, as verl's reward-model path has them: a discriminative reward model (a Hugging Face
`*ForSequenceClassification` checkpoint; SGLang serves it as a pooling model and answers
`/classify` with its logit) and a generative judge (a chat or completion model given a rubric
template; its verdict text is parsed). `reward.source` (config/reward.py) decides how the model's
score mixes with the verifier's reward.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from areal_jobs.config.rollout import RolloutEngine


class RewardModelKind(enum.Enum):
    discriminative = "discriminative"  # *ForSequenceClassification: one logit per answer
    generative = "generative"  # a judge model: a rubric prompt, a generated verdict, a parser


class ScoreTransform(enum.Enum):
    """How a discriminative model's logit becomes the reward."""

    sigmoid = "sigmoid"  # a correctness classifier's probability of "right", in (0, 1)
    raw = "raw"  # the logit itself (a Bradley-Terry preference model's score)


class VerdictParser(enum.Enum):
    """How a judge's generated text becomes a score (reward/verdict.py)."""

    # the first match of reward.model.verdict_regex's one group, a number, divided by
    # reward.model.score_max (e.g. "Score: 7" out of 10)
    score_regex = "score_regex"
    # yes / no: the first of reward.model.yes_words / no_words in the verdict, 1.0 or 0.0
    yes_no = "yes_no"
    # the judge solves the problem itself: 1.0 when the answer verdict_regex finds in the verdict
    # equals the one it finds in the response, else 0.0 (a reference-free consistency judge)
    answer_match = "answer_match"


class RewardModelInput(enum.Enum):
    """What a discriminative model reads."""

    raw = "raw"  # the prompt's ids then the response's ids, each encoded with the model's tokenizer
    chat = "chat"  # the model tokenizer's chat template over [user: prompt, assistant: response]


@dataclass
class RewardModelConfig:
    """The reward-model role: its servers and how its answers are scored."""

    kind: RewardModelKind = RewardModelKind.discriminative
    path: str = ""  # Hugging Face directory of the reward model or judge; "" = no reward model
    engine: RolloutEngine = RolloutEngine.sglang  # what serves it
    num_servers: int = 1  # local mode: reward-model servers started by launch.local
    tp_size: int = 1  # GPUs per reward-model server (cluster mode)
    max_total_tokens: int = 16384  # KV/pool capacity in tokens per server (CPU mode)
    server_threads: int = 1  # torch threads per server process (CPU mode)
    base_port: int = 0  # server i listens on base_port + i; 0 = any free port
    gpu_memory_fraction: float = 0.0  # cluster mode: a GPU shared with another role
    extra_server_args: list[str] = field(default_factory=list)  # appended to the engine's command line
    # the planner (launch/planning/fit/reward_plan.py): the model's shape where reward.model.path is not
    # on the submitting machine (a named shape, as model.shape), and one server's measured scoring
    # throughput in answers/s (`python -m bench --only reward_model` on the reward nodes' hardware);
    # 0 = the planner cannot check that the reward servers keep up with the rollout, and says so
    shape: str = ""
    answers_per_s: float = 0.0  # one server's measured throughput for the planner (above); 0 = unknown
    # requests: answers go out in batches of at most batch_size per HTTP call (a discriminative
    # call scores the whole batch in one forward pass); each call has request_timeout_s, safe
    # calls are repeated with backoff until deadline_s (the answer's deadline, counted from its
    # first attempt); past it the answer's reward fails (model_error), never a silent 0
    batch_size: int = 16
    request_timeout_s: float = 60.0
    deadline_s: float = 180.0
    backoff_s: float = 0.5  # pause before the first repeat of a call; doubles per repeat
    max_backoff_s: float = 10.0  # the longest pause between repeats
    # discriminative
    input: RewardModelInput = RewardModelInput.raw
    transform: ScoreTransform = ScoreTransform.sigmoid
    label: int = 0  # which logit of a multi-label head is the score
    # generative judge: the template is str.format over {prompt}, {response}, {reference}; "@path"
    # reads it from a file. Sampled greedily (temperature 0): the same answer gets the same verdict
    judge_template: str = (
        "Question:\n{prompt}\n\nAnswer:\n{response}\n\n"
        "Is the answer correct? Rate it from 0 to 10 and reply with 'Score: N'."
    )
    judge_chat: bool = False  # wrap the rendered template as the user turn of the judge's chat template
    judge_max_new_tokens: int = 256  # generative judge: its verdict's length cap
    parser: VerdictParser = VerdictParser.score_regex
    verdict_regex: str = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"  # score_regex: one group, the number
    score_max: float = 10.0  # score_regex: the score is the number divided by this
    yes_words: list[str] = field(default_factory=lambda: ["yes", "correct"])  # yes_no: a verdict of 1.0
    no_words: list[str] = field(default_factory=lambda: ["no", "incorrect", "wrong"])  # yes_no: 0.0
    # the score at or above which the model calls an answer right: agreement with the verifier
    # and the exploit rate (reward/model_*) are counted against it
    correct_threshold: float = 0.5

    def __post_init__(self) -> None:
        for name in ("num_servers", "tp_size", "batch_size", "judge_max_new_tokens", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"reward.model.{name} must be >= 1")
        if self.request_timeout_s <= 0 or self.deadline_s < self.request_timeout_s:
            raise ValueError(
                "reward.model.deadline_s must be >= reward.model.request_timeout_s > 0: e.g. "
                f"reward.model.deadline_s={max(self.request_timeout_s, 1.0) * 3:g}"
            )
        try:
            pattern = re.compile(self.verdict_regex)
        except re.error as exc:
            raise ValueError(
                f"reward.model.verdict_regex={self.verdict_regex!r} is not a regex: {exc}"
            ) from None
        if self.kind is RewardModelKind.generative:
            if self.parser in (VerdictParser.score_regex, VerdictParser.answer_match) and pattern.groups != 1:
                raise ValueError(
                    f"reward.model.verdict_regex={self.verdict_regex!r} must have exactly one group "
                    f"(the {'score' if self.parser is VerdictParser.score_regex else 'answer'}) "
                    f"for reward.model.parser={self.parser.value}"
                )
            if self.parser is VerdictParser.score_regex and self.score_max <= 0:
                raise ValueError("reward.model.score_max must be > 0 (the score is the number / score_max)")
            if self.parser is VerdictParser.yes_no and not (self.yes_words and self.no_words):
                raise ValueError("reward.model.yes_words and reward.model.no_words must not be empty")
            if (
                not self.judge_template.startswith("@")
                and "{response}" not in self.judge_template
                and (self.parser is not VerdictParser.answer_match)
            ):
                raise ValueError(
                    "reward.model.judge_template has no {response} field: the judge would never see the "
                    "answer it grades (or use reward.model.parser=answer_match)"
                )
        if self.kind is RewardModelKind.discriminative and self.engine is not RolloutEngine.sglang:
            raise ValueError(
                "reward.model.kind=discriminative is served by SGLang (/classify returns the head's "
                "logits); vLLM's /classify returns activated probabilities and is not wired: set "
                "reward.model.engine=sglang (a generative judge runs on either engine)"
            )
        if self.answers_per_s < 0:
            raise ValueError("reward.model.answers_per_s must be >= 0 (0 = not measured: not checked)")
        if self.label < 0:
            raise ValueError("reward.model.label must be >= 0")
