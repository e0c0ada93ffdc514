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
    "greedy_accuracy_start",
    "greedy_accuracy_end",
    "pass_at_k_start",
    "pass_at_k_end",
    "steps",
    "wall_s",
    "max_staleness_seen",
    "interrupted_requests",
)
OPTIONAL_FINAL_KEYS = ("tool_calls_start", "tool_calls_end")  # tool workflows (trainer/session.py)


def final_line(summary: dict) -> str:
    """The one line a run prints at the end (the same keys as summary.json)."""
    parts = []
    for key in FINAL_KEYS + tuple(k for k in OPTIONAL_FINAL_KEYS if k in summary):
        value = summary.get(key)
        parts.append(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}")
    return "final: " + " ".join(parts)


LENGTH_COLUMNS = ("greedy_start", "greedy_end", "sampled_start", "sampled_end")


def length_table(by_length: dict[str, dict]) -> str:
    """summary.json's `by_length` as an aligned text table (one row per chain-length bucket)."""
    lines = ["steps   prompts  " + "  ".join(f"{c:>13s}" for c in LENGTH_COLUMNS)]
    for bucket, row in by_length.items():
        cells = [
            f"{row[c]:13.3f}" if isinstance(row.get(c), float) else f"{'-':>13s}" for c in LENGTH_COLUMNS
        ]
        lines.append(f"{bucket:7s} {row.get('num_prompts', 0):7d}  " + "  ".join(cells))
    return "\n".join(lines)


def source_table(by_source: dict[str, dict]) -> str:
    """summary.json's `by_source` as an aligned text table (one row per mixture source): held-out
    accuracy at the start and the end, and the last training batches' reward and accuracy."""
    columns = (*LENGTH_COLUMNS, "train_reward", "train_accuracy")
    width = max(7, *(len(name) for name in by_source)) if by_source else 7
    lines = [f"{'source':{width}s} prompts  " + "  ".join(f"{c:>14s}" for c in columns)]
    for name, row in by_source.items():
        cells = [f"{row[c]:14.3f}" if isinstance(row.get(c), float) else f"{'-':>14s}" for c in columns]
        lines.append(f"{name:{width}s} {row.get('num_prompts', 0):7d}  " + "  ".join(cells))
    return "\n".join(lines)


def write_summary(run_dir: Path, summary: dict) -> Path:
    path = run_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2, sort_keys=True))
    return path


def plot_run(run_dir: Path, summary: dict | None = None) -> Path | None:
    """Reward (training batches) and held-out accuracy against step, as PNG; beside it, accuracy per
    chain length before and after training when `summary` has a `by_length` table."""
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
    table = (summary or {}).get("by_length") or {}
    if table:
        fig, (ax, ax_len) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [7, 6]})
        _plot_lengths(ax_len, table)
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train reward (batch mean)", alpha=0.6)
    if acc:
        ax.plot(*zip(*acc), "o-", label="held-out accuracy (sampled)")
    if greedy:
        ax.plot(*zip(*greedy), "s--", label="held-out accuracy (greedy)")
    calls = [(r["step"], r["episode/tool_calls"]) for r in rows if r.get("episode/tool_calls")]
    if calls:  # a tool workflow: calls per episode of each trained batch, on their own scale
        twin = ax.twinx()
        steps, values = zip(*calls)
        smooth = [
            sum(values[max(0, i - 4) : i + 1]) / len(values[max(0, i - 4) : i + 1])
            for i in range(len(values))
        ]
        twin.plot(steps, values, color="tab:purple", alpha=0.25)
        twin.plot(steps, smooth, color="tab:purple", label="tool calls per episode (batch, mean of 5)")
        twin.set_ylabel("tool calls per episode")
        twin.set_ylim(bottom=0)
        twin.legend(loc="upper left")
    ax.set_xlabel("training step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(run_dir.name)
    out = run_dir / "reward_accuracy.png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    if any("reward/model_judged" in r for r in rows):
        plot_reward_model(run_dir, rows)
    return out


def reward_model_windows(rows: list[dict], window: int = 5) -> list[dict[str, float]]:
    """Per training step, over the answers scored in the last `window` steps' worth of rollout
    stats (reward/combined.py's cumulative counts, differenced): the reward model's mean score,
    the verifier's accuracy on the same answers, the model's agreement with it and its exploit
    rate (of the answers the model calls right, the share the verifier says are wrong)."""
    stats = [r for r in rows if "reward/model_judged" in r and "train/version" in r]
    out = []
    for i in range(window, len(stats)):
        a, b = stats[i - window], stats[i]

        def delta(key: str, a=a, b=b) -> float:
            return b.get(key, 0.0) - a.get(key, 0.0)

        judged = delta("reward/model_judged")
        if judged <= 0:
            continue
        out.append(
            {
                "step": b["step"],
                "model_score": delta("reward/model_judged_score_sum") / judged,
                "verifier_accuracy": delta("reward/verifier_correct")
                / max(delta("reward/verifier_answers"), 1.0),
                "agreement": delta("reward/model_agreed") / judged,
                "exploit_rate": delta("reward/model_exploited") / max(delta("reward/model_positive"), 1.0),
            }
        )
    return out


def plot_reward_model(run_dir: Path, rows: list[dict]) -> Path | None:
    """reward_model.png: a policy trained on a reward model's score, against the verifier. The
    model's mean score and the verifier's accuracy on the same training answers, the exploit rate,
    and the held-out accuracy by the verifier: where the score rises and the verifier's accuracy
    does not, the policy has learned to please the model."""
    import matplotlib.pyplot as plt

    windows = reward_model_windows(rows)
    if not windows:
        return None
    steps = [w["step"] for w in windows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, [w["model_score"] for w in windows], label="reward-model score (training answers)")
    ax.plot(steps, [w["verifier_accuracy"] for w in windows], label="verifier accuracy (same answers)")
    ax.plot(
        steps,
        [w["exploit_rate"] for w in windows],
        "--",
        label="exploit rate: model says right, verifier wrong",
    )
    held = [
        (r.get("eval/greedy_version", r["step"]), r["eval/greedy_accuracy"])
        for r in rows
        if "eval/greedy_accuracy" in r
    ]
    if held:
        ax.plot(*zip(*held), "s:", label="held-out accuracy (greedy, verifier)")
    ax.set_xlabel("training step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(f"{run_dir.name}: reward model vs verifier (windows of 5 steps)")
    out = run_dir / "reward_model.png"
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _plot_lengths(ax, table: dict[str, dict]) -> None:
    """Grouped bars: held-out accuracy per chain-length bucket, greedy and sampled, start and end."""
    buckets = list(table)
    styles = {"greedy_start": ("#9ecae1", ""), "greedy_end": ("#08519c", ""),
              "sampled_start": ("#fdae6b", "//"), "sampled_end": ("#a63603", "//")}  # fmt: skip
    width = 0.8 / len(LENGTH_COLUMNS)
    for j, column in enumerate(LENGTH_COLUMNS):
        xs = [i + (j - 1.5) * width for i in range(len(buckets))]
        ys = [table[b].get(column) or 0.0 for b in buckets]
        color, hatch = styles[column]
        ax.bar(xs, ys, width, label=column.replace("_", " "), color=color, hatch=hatch, edgecolor="white")
    ax.set_xticks(range(len(buckets)))
    ax.set_xticklabels([f"{b}\n(n={table[b].get('num_prompts', 0)})" for b in buckets])
    ax.set_xlabel("chain length (steps)")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title("before / after RL, by chain length")
