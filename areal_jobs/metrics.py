"""Metrics: flat `a/b` keys with float values, sent through one sink per process.

Sinks: JSONL (always; the launcher's progress bar and summary read it), TensorBoard (imported
lazily, only when enabled). The trainer process owns the run's sink; the controller sends its
rollout metrics to the trainer over the control channel, so one file holds one run.
"""

from __future__ import annotations

import json
import logging
import secrets
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


class WandbSink:
    """Weights & Biases with the same flat keys. Offline (RUN_DIR/wandb/offline-run-*, synced later
    with `wandb sync`) when asked, or in mode auto when no API key is configured. The run id is
    kept in RUN_DIR/wandb_id so a resumed job continues the same W&B run."""

    def __init__(
        self, run_dir: Path, *, project: str, name: str, group: str, mode: str, config: dict
    ) -> None:
        import wandb  # lazy: only when enabled (the `viz` extra)

        id_file = run_dir / "wandb_id"
        if not id_file.exists():
            id_file.write_text(secrets.token_hex(4))
        auto = mode == "auto"
        mode = ("online" if _wandb_key_configured() else "offline") if auto else mode

        def start(mode: str):
            return wandb.init(
                project=project,
                name=name,
                group=group or None,
                mode=mode,
                dir=str(run_dir),
                id=id_file.read_text().strip(),
                resume="allow",
                config=config,
                settings=wandb.Settings(silent=True, console="off"),
            )

        try:
            self._run = start(mode)
        except Exception as exc:  # a key but no network: keep the run, sync it later
            if not (auto and mode == "online"):
                raise
            logger.warning("W&B online start failed (%s); logging offline instead", exc)
            mode = "offline"
            self._run = start(mode)
        self.mode = mode
        logger.info("W&B %s run %s in %s", mode, self._run.id, self._run.dir)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log({k: float(v) for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        import wandb

        self._run.finish()
        wandb.teardown()  # stops W&B's service process: the offline run file is complete after this


def _wandb_key_configured() -> bool:
    import os

    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="replace")


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


def build_sink(run_dir: Path, tensorboard: bool, wandb: dict | None = None) -> FanoutSink:
    """`wandb`: WandbSink's keyword arguments (project, name, group, mode, config), or None."""
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl")]
    if wandb is not None:
        try:
            sinks.append(WandbSink(run_dir, **wandb))
        except ImportError as exc:  # asked for explicitly: say how to get it, but keep the run
            logger.warning("W&B disabled (%s): pip install wandb (the viz extra)", exc)
    if tensorboard:
        try:
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        except ImportError as exc:  # a missing optional dependency must not stop a run
            logger.warning("TensorBoard disabled (%s); set run.tensorboard=false to silence", exc)
    return FanoutSink(sinks)


def read_jsonl(path: Path) -> list[dict[str, float]]:
    """The complete rows. The launcher and the replanner read while the trainer appends, and a
    long row can reach the file in more than one write: a last line without its newline is a row
    still being written, left for the next read."""
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]
