"""Checkpoint layout and the commit rule (pure file handling; the trainer coordinates).

    RUN_DIR/checkpoints/step_000012/trainer/      model, optimiser, RNG (backend.save_checkpoint)
                                   /rollout/      controller snapshot (rollout/snapshot.py)
                                   /meta.json     step, version, loop counters, evaluations
    RUN_DIR/checkpoints/latest                    name of the newest *complete* checkpoint

A checkpoint counts only once `latest` names it, and `latest` is replaced atomically after both
halves and meta.json are on disk. A crash while saving leaves the previous one in charge.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from areal_jobs.atomic import write_atomic


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    pointer = checkpoints_dir(run_dir) / "latest"
    if not pointer.exists():
        return None
    folder = checkpoints_dir(run_dir) / pointer.read_text().strip()
    if not (folder / "meta.json").exists():
        raise FileNotFoundError(
            f"{pointer} names {folder}, which is incomplete: delete {pointer} to start over"
        )
    return folder


def read_meta(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text())


def commit(run_dir: Path, folder: Path, meta: dict, keep_last: int) -> None:
    """Write meta.json, then point `latest` at `folder`, then prune older checkpoints."""
    write_atomic(folder / "meta.json", json.dumps(meta, indent=2))
    write_atomic(checkpoints_dir(run_dir) / "latest", folder.name)
    done = sorted(p for p in checkpoints_dir(run_dir).glob("step_*") if (p / "meta.json").exists())
    for old in done[: max(0, len(done) - max(keep_last, 1))]:
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)


def truncate_jsonl(path: Path, step: int) -> int:
    """Keep rows of steps <= `step` (the ledger and metrics of what the checkpoint's model saw)."""
    if not path.exists():
        return 0
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in rows if json.loads(line)["step"] <= step]
    write_atomic(path, "".join(line + "\n" for line in kept))
    return len(rows) - len(kept)
