"""What `launch.evaluate` writes: one JSON (summary, pass@k curve, per-problem rows) and one PNG
(pass@k against k with the greedy accuracy; the answer-length histogram with the token limit)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from areal_jobs.rollout.eval_metrics import ProblemScores, sampled_metrics
from areal_jobs.rollout.evaluation import EvalOutcome

logger = logging.getLogger("launch.evaluate")


def build_report(sampled: EvalOutcome, greedy: EvalOutcome | None, ks: list[int], meta: dict) -> dict:
    """The JSON content: `meta` (checkpoint, data, sampling) plus the metrics and per-problem rows."""
    s = sampled.summary
    n = s.samples_per_problem
    scores = [ProblemScores(p.rewards, p.lengths, p.truncated) for p in sampled.problems]
    curve = sampled_metrics(scores, range(1, n + 1)).pass_at_k  # every k, for the plot
    greedy_rows = {p.index: p for p in greedy.problems} if greedy else {}
    problems = []
    for p in sampled.problems:
        row = {"index": p.index, "reference": p.reference, "num_correct": sum(r >= 1.0 for r in p.rewards),
               "rewards": p.rewards, "lengths": p.lengths, "truncated": p.truncated,
               "first_answer": p.texts[0]}  # fmt: skip
        if p.index in greedy_rows:
            g = greedy_rows[p.index]
            row.update(greedy_reward=g.rewards[0], greedy_length=g.lengths[0], greedy_answer=g.texts[0])
        problems.append(row)
    return {
        **meta,
        "num_problems": s.num_prompts,
        "samples_per_problem": n,
        "pass@1": s.accuracy,
        "pass@k": {str(k): curve[k] for k in ks},
        "greedy_accuracy": greedy.summary.accuracy if greedy else None,
        "mean_length_tokens": s.mean_length_tokens,
        "truncation_rate": s.truncation_rate,
        "mean_reward": s.mean_reward,
        "greedy_mean_length_tokens": greedy.summary.mean_length_tokens if greedy else None,
        "greedy_truncation_rate": greedy.summary.truncation_rate if greedy else None,
        "pass_at_k_curve": {str(k): v for k, v in curve.items()},
        "problems": problems,
    }


def summary_line(report: dict) -> str:
    """The one line `launch.evaluate` prints."""
    parts = [f"pass@1={report['pass@1']:.3f}"]
    parts += [f"pass@{k}={v:.3f}" for k, v in report["pass@k"].items() if k != "1"]
    if report["greedy_accuracy"] is not None:
        parts.append(f"greedy={report['greedy_accuracy']:.3f}")
    parts += [
        f"mean_length={report['mean_length_tokens']:.1f}",
        f"truncation_rate={report['truncation_rate']:.3f}",
        f"problems={report['num_problems']}",
        f"samples={report['samples_per_problem']}",
    ]
    return "eval: " + " ".join(parts)


def write_report(out_dir: Path, report: dict) -> tuple[Path, Path | None]:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "eval.json"
    path.write_text(json.dumps(report, indent=2))
    return path, plot_report(out_dir / "eval.png", report)


def plot_report(path: Path, report: dict) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib missing: no plot written")
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    curve = {int(k): v for k, v in report["pass_at_k_curve"].items()}
    left.plot(list(curve), list(curve.values()), "o-", label="pass@k (unbiased, sampled)")
    if report["greedy_accuracy"] is not None:
        left.axhline(report["greedy_accuracy"], color="tab:red", ls="--", label="greedy accuracy")
    left.set_xlabel("k")
    left.set_ylim(0, 1)
    left.grid(alpha=0.3)
    left.legend(loc="lower right")
    left.set_title(f"{report['data']}: {report['num_problems']} problems x {report['samples_per_problem']}")
    lengths = [x for p in report["problems"] for x in p["lengths"]]
    right.hist(lengths, bins=30, color="tab:gray")
    right.axvline(report["max_new_tokens"], color="tab:red", ls="--", label="max_new_tokens")
    right.set_xlabel("answer length (tokens)")
    right.set_ylabel("samples")
    right.legend()
    right.set_title(f"truncated: {report['truncation_rate']:.1%}")
    fig.suptitle(Path(report["checkpoint"]).name or report["checkpoint"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
