"""A judge's verdict text -> a score, and the judge's prompt from its template. Pure.

The parser is configuration (reward.model.parser): `score_regex` reads a number ("Score: 7",
divided by reward.model.score_max), `yes_no` the first yes- or no-word, `answer_match` compares the
answer the judge reached with the one the response states (a reference-free consistency judge:
the judge solves the problem itself). A verdict none of them can read is None, which the scorer
records as RewardStatus.model_error: an unreadable verdict is a failed reward, never a 0.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from areal_jobs.config import RewardModelConfig, VerdictParser


def load_template(template: str) -> str:
    """reward.model.judge_template, or the file it names with a leading "@"."""
    if not template.startswith("@"):
        return template
    path = Path(template[1:])
    try:
        return path.read_text()
    except OSError as exc:
        raise ValueError(f"reward.model.judge_template={template}: cannot read {path}: {exc}") from None


def render(template: str, prompt: str, response: str, reference: str) -> str:
    """The judge's prompt. Only the three named fields: a brace in the prompt or response text is
    data, not a field (they are substituted after the template is split on its own fields)."""
    try:
        return template.format(prompt=prompt, response=response, reference=reference)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"reward.model.judge_template uses a field other than {{prompt}}, {{response}}, {{reference}} "
            f"or an unescaped brace: {exc!r}"
        ) from None


class VerdictReader:
    """reward.model's parser settings, compiled once."""

    def __init__(self, cfg: RewardModelConfig) -> None:
        self.parser = cfg.parser
        self.pattern = re.compile(cfg.verdict_regex)
        self.score_max = cfg.score_max
        self.yes = tuple(w.lower() for w in cfg.yes_words)
        self.no = tuple(w.lower() for w in cfg.no_words)

    def score(self, verdict: str, response: str = "") -> tuple[float | None, str]:
        """(score, why): score None when the verdict cannot be read; `why` says what was found."""
        if self.parser is VerdictParser.score_regex:
            match = self.pattern.search(verdict)
            if match is None:
                return None, "no score in the verdict"
            try:
                value = float(match.group(1))
            except ValueError:
                return None, f"score {match.group(1)!r} is not a number"
            if not math.isfinite(value):
                return None, f"score {match.group(1)!r} is not finite"
            return value / self.score_max, ""
        if self.parser is VerdictParser.yes_no:
            words = re.findall(r"[a-z]+", verdict.lower())
            for word in words:  # the first decisive word: "no, it is correct" reads as no
                if word in self.no:
                    return 0.0, ""
                if word in self.yes:
                    return 1.0, ""
            return None, "neither a yes- nor a no-word in the verdict"
        # answer_match
        judged = self.pattern.search(verdict)
        if judged is None:
            return None, "the judge reached no answer"
        stated = self.pattern.search(response)
        if stated is None:  # the response states no answer: the judge can read that as wrong
            return 0.0, "the response states no answer"
        return (1.0 if judged.group(1).strip() == stated.group(1).strip() else 0.0), ""
