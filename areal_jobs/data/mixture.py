"""Mixtures (data.sources): several datasets in one stream, each with its weight and its reward.

The stream is a pure function of (seed, position), like a single dataset's, so a checkpoint keeps
only the position. Positions are cut into windows of W; in every window source i has exactly
c_i = W * w_i positions (largest remainder when W * w_i is not whole), spread by smooth weighted
round robin (nginx's: each slot goes to the source furthest behind its share), the same slot
table in every window:

    weights 0.7 / 0.3, W = 10:   a b a a a b a a b a | a b a a a b a a b a | ...

Position p is window k = p // W, slot o = p % W; its source s = table[o] takes its own
k * c_s + (slots of s before o)-th prompt, from its own stream (its rows in a fresh seeded order
each epoch). Every prompt carries its source's name (per-source metrics) and reward.
"""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction
from typing import Protocol

from areal_jobs.config import DataConfig, SourceConfig
from areal_jobs.reward.registry import REWARD_TARGETS

MAX_EXACT_WINDOW = 1000  # weights needing a longer window are rounded (largest remainder) over this
EVAL_INDEX_STRIDE = 1_000_000  # source i's held-out indices start at -1 - i * stride: never shared


def window_counts(weights: list[float], window: int = 0) -> list[int]:
    """Positions per source in each window. window 0: the smallest W with W * w_i / sum(w) whole
    (weights as fractions of denominator <= 1000), capped at MAX_EXACT_WINDOW."""
    total = sum(weights)
    shares = [Fraction(w / total).limit_denominator(MAX_EXACT_WINDOW) for w in weights]
    if window == 0:
        window = math.lcm(*(s.denominator for s in shares))
        if window > MAX_EXACT_WINDOW:
            window = MAX_EXACT_WINDOW
    exact = [s / sum(shares) * window for s in shares]
    counts = [math.floor(x) for x in exact]
    # largest remainder; ties to the earlier source, so the table is deterministic
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: window - sum(counts)]:
        counts[i] += 1
    return counts


def slot_table(counts: list[int]) -> list[int]:
    """Smooth weighted round robin over one window: the source of each slot."""
    window, current, table = sum(counts), [0] * len(counts), []
    for _ in range(window):
        current = [c + n for c, n in zip(current, counts)]
        best = max(range(len(counts)), key=lambda i: (current[i], -i))
        current[best] -= window
        table.append(best)
    return table


class _Stream(Protocol):
    def at(self, index: int): ...  # a Prompt (data/prompts.py)


class MixtureStream:
    """Prompts by position over several sources; the same interface as PromptStream."""

    def __init__(self, streams: list[_Stream], names: list[str], counts: list[int]) -> None:
        if any(c == 0 for c in counts):
            zero = names[counts.index(0)]
            raise ValueError(
                f"source {zero} gets no position in a window of {sum(counts)}: "
                "raise its weight or data.mixture_window"
            )
        self.streams, self.names, self.counts = streams, names, counts
        self.table = slot_table(counts)
        self.window = len(self.table)
        # rank[o]: how many slots of table[o]'s source come before slot o in the window
        seen = [0] * len(counts)
        self.rank = []
        for s in self.table:
            self.rank.append(seen[s])
            seen[s] += 1
        self.rows = None  # no single file's rows (rollout/main checks humaneval references)
        self.position = 0

    def source_at(self, index: int) -> tuple[int, int]:
        """(source, its own position) of stream position `index`."""
        window, slot = divmod(index, self.window)
        source = self.table[slot]
        return source, window * self.counts[source] + self.rank[slot]

    def at(self, index: int):
        source, local = self.source_at(index)
        return replace(self.streams[source].at(local), data_index=index)

    def next(self):
        prompt = self.at(self.position)
        self.position += 1
        return prompt


def source_config(data: DataConfig, source: SourceConfig, index: int) -> DataConfig:
    """The DataConfig of one source: its rows and keys, the run's prompt format and limits, and
    its own seed (two sources of one built-in task see different problems)."""
    return DataConfig(
        dataset=source.dataset,
        train_path=source.path,
        eval_path=source.eval_path,
        format=source.format,
        num_eval_prompts=source.num_eval_prompts,
        max_prompt_tokens=data.max_prompt_tokens,
        seed=data.seed + 1009 * index,
        chat_template=data.chat_template,
        system_prompt=data.system_prompt,
        instruction=data.instruction if source.instruction is None else source.instruction,
        prompt_key=source.prompt_key,
        answer_key=source.answer_key,
    )


def check_reward(reward: str, key: str) -> None:
    """A built-in verifier's name or a function spec (resolved by the reward registry)."""
    if reward and ":" not in reward and (reward not in REWARD_TARGETS or reward == "tool_python"):
        names = sorted(set(REWARD_TARGETS) - {"tool_python"})
        raise ValueError(
            f"{key}.reward={reward} is not a verifier ({', '.join(names)}) nor a function "
            "spec path/to/file.py:fn or package.module:fn ('' = the dataset's default)"
        )
