"""Sample dumps: what the policy was asked, what it answered, and how that was scored.

RUN_DIR/samples.jsonl gets one JSON object per sample, from training batches (every
run.samples_every_steps steps, written by trainer rank 0) and from every evaluation (written by
the controller). Both processes append whole lines with O_APPEND writes, so the file stays one
valid JSONL. The first `print_first` samples of each dump are logged: the first thing to read when
a reward curve looks wrong.

    {"kind": "train", "step": 10, "prompt": "...", "response": "...", "reward": 0.0,
     "reward_status": "ok", "version_min": 7, "version_max": 9, "stop_reason": "stop"}
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleRecord:
    kind: str  # "train", or the evaluation's kind ("start", "periodic", "final", "*_greedy")
    step: int  # trainer step (train) or the policy version evaluated (eval)
    prompt: str  # decoded with special tokens: the chat markup the model saw
    response: str
    reward: float
    reward_status: str  # "ok", "timeout", "error", ... (reward/non_ok counts the others)
    version_min: int  # oldest policy version of the response's tokens
    version_max: int  # newest
    stop_reason: str  # "stop" (end token or stop string) or "length" (max_new_tokens)


class SampleDump:
    def __init__(self, path: Path, print_first: int = 2) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.print_first = print_first

    def write(self, records: Sequence[SampleRecord]) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            for rec in records:
                os.write(fd, (json.dumps(asdict(rec), ensure_ascii=False) + "\n").encode())
        finally:
            os.close(fd)
        for rec in records[: self.print_first]:
            logger.info(
                "sample %s step %d (reward %.2f %s, versions %d..%d, %s):\nPROMPT: %s\nRESPONSE: %s",
                rec.kind, rec.step, rec.reward, rec.reward_status, rec.version_min, rec.version_max,
                rec.stop_reason, _clip(rec.prompt), _clip(rec.response),
            )  # fmt: skip


def _clip(text: str, limit: int = 600) -> str:
    return text if len(text) <= limit else text[: limit // 2] + " [...] " + text[-limit // 2 :]


def train_records(step: int, groups: Sequence, decode: Callable[[list[int]], str]) -> list[SampleRecord]:
    """Records of one training batch's groups (transport.messages.TrajectoryGroup)."""
    out = []
    for g in groups:
        prompt = decode(g.prompt_ids.tolist())
        for s in g.samples:
            versions = s.versions.tolist() or [0]
            out.append(
                SampleRecord(
                    "train",
                    step,
                    prompt,
                    decode(s.output_ids.tolist()),
                    float(s.reward),
                    s.reward_status,
                    min(versions),
                    max(versions),
                    s.finish_reason,
                )  # fmt: skip
            )
    return out
