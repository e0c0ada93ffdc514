"""Metrics: flat `a/b` keys with float values, sent through one sink per process.

Sinks: JSONL (always; the launcher's progress bar and summary read it), TensorBoard (imported
lazily, only when enabled). The trainer process owns the run's sink; the controller sends its
rollout metrics to the trainer over the control channel, so one file holds one run.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per call: {"step": s, "time": t, "a/b": v, ...}."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: only when enabled

        self._writer = SummaryWriter(str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class FanoutSink:
    """The one sink a process uses; forwards to every configured backend."""

    def __init__(self, sinks: list[MetricsSink]) -> None:
        self._sinks = sinks

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self._sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()


def build_sink(run_dir: Path, tensorboard: bool) -> FanoutSink:
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl")]
    if tensorboard:
        try:
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        except ImportError as exc:  # a missing optional dependency must not stop a run
            logger.warning("TensorBoard disabled (%s); set run.tensorboard=false to silence", exc)
    return FanoutSink(sinks)


def read_jsonl(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows
