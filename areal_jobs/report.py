"""End-of-run outputs: summary.json and a PNG of reward and held-out accuracy against step."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from areal_jobs.metrics import read_jsonl

logger = logging.getLogger(__name__)

FINAL_KEYS = (
    "accuracy_start",
    "accuracy_end",
    "pass_at_k_start",
    "pass_at_k_end",
    "steps",
    "wall_s",
    "max_staleness_seen",
    "interrupted_requests",
)


def final_line(summary: dict) -> str:
    """The one line a run prints at the end (the same keys as summary.json)."""
    parts = []
    for key in FINAL_KEYS:
        value = summary.get(key)
        parts.append(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}")
    return "final: " + " ".join(parts)


def write_summary(run_dir: Path, summary: dict) -> Path:
    path = run_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2, sort_keys=True))
    return path


def plot_run(run_dir: Path) -> Path | None:
    """Reward (training batches) and held-out accuracy against step, as PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib missing: no plot written")
        return None
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    # an evaluation belongs to the policy version it measured (version v = after v steps)
    acc = [(r.get("eval/version", r["step"]), r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    greedy = [
        (r.get("eval/greedy_version", r["step"]), r["eval/greedy_accuracy"])
        for r in rows
        if "eval/greedy_accuracy" in r
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train reward (batch mean)", alpha=0.6)
    if acc:
        ax.plot(*zip(*acc), "o-", label="held-out accuracy (sampled)")
    if greedy:
        ax.plot(*zip(*greedy), "s--", label="held-out accuracy (greedy)")
    ax.set_xlabel("training step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(run_dir.name)
    out = run_dir / "reward_accuracy.png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
