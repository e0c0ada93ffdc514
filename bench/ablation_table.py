"""The staleness ablation's pure half: one record per run -> the paper's Table 2 layout.

A run record (what bench/ablate.py reads back from one launch.local run) is a dict:
  eta, objective ("decoupled" | "naive"), seed, greedy_end, sampled_end, tokens_per_s,
  curve: [[policy version, sampled accuracy (eval/pass@1) or None, greedy accuracy or None], ...]
Failed runs carry "error" and are left out of the table (the table says how many seeds it used).

Across seeds a cell is the mean and the half-range ((max - min) / 2): with 2 seeds that is the
distance from the mean to either seed, so "0.62 ± 0.03" means the seeds gave 0.59 and 0.65.
"""

from __future__ import annotations

OBJECTIVES = ("decoupled", "naive")
COLUMNS = ("greedy_end", "sampled_end", "tokens_per_s")


def mean_spread(values: list[float]) -> dict[str, float] | None:
    """Mean and half-range of the finite values; None when there is none."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    return {"mean": sum(xs) / len(xs), "spread": (max(xs) - min(xs)) / 2, "n": len(xs)}


def aggregate(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """{str(eta): {objective: {column: mean_spread, "seeds": n}}} over the runs without error."""
    table: dict[str, dict[str, dict]] = {}
    ok = [r for r in runs if "error" not in r]
    for eta in sorted({r["eta"] for r in runs}):
        row = {}
        for objective in OBJECTIVES:
            cell_runs = [r for r in ok if r["eta"] == eta and r["objective"] == objective]
            if not [r for r in runs if r["eta"] == eta and r["objective"] == objective]:
                continue  # this objective was not part of the ablation
            cell = {col: mean_spread([r.get(col) for r in cell_runs]) for col in COLUMNS}
            cell["seeds"] = len(cell_runs)
            row[objective] = cell
        table[str(eta)] = row
    return table


def _fmt(stat: dict | None, digits: int) -> str:
    if stat is None:
        return "-"
    if stat["n"] < 2:
        return f"{stat['mean']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} ± {stat['spread']:.{digits}f}"


def markdown(table: dict[str, dict[str, dict]]) -> str:
    """Rows η; per objective: final greedy and sampled held-out accuracy, trained tokens/s."""
    objectives = [o for o in OBJECTIVES if any(o in row for row in table.values())]
    header = ["η"]
    for o in objectives:
        header += [f"{o} greedy", f"{o} sampled", f"{o} tokens/s"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for eta, row in table.items():
        cells = [eta]
        for o in objectives:
            cell = row.get(o)
            if cell is None:
                cells += ["-", "-", "-"]
                continue
            cells += [
                _fmt(cell["greedy_end"], 3),
                _fmt(cell["sampled_end"], 3),
                _fmt(cell["tokens_per_s"], 0),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    seeds = sorted({c["seeds"] for row in table.values() for c in row.values()})
    lines.append("")
    lines.append(
        f"mean ± half-range over seeds ({'/'.join(map(str, seeds)) or 0} per cell); held-out accuracy at the end"
    )
    return "\n".join(lines)


def mean_curves(runs: list[dict], objective: str) -> dict[int, dict[str, list[tuple[int, float]]]]:
    """Per η: the held-out accuracy curves of `objective`, averaged over seeds at each version
    (a version some seed did not evaluate is averaged over the seeds that did)."""
    out: dict[int, dict[str, list[tuple[int, float]]]] = {}
    for eta in sorted({r["eta"] for r in runs}):
        chosen = [r for r in runs if r["eta"] == eta and r["objective"] == objective and "error" not in r]
        if not chosen:
            continue
        curves = {}
        for index, name in ((1, "sampled"), (2, "greedy")):
            by_version: dict[int, list[float]] = {}
            for r in chosen:
                for point in r["curve"]:
                    if point[index] is not None:
                        by_version.setdefault(int(point[0]), []).append(float(point[index]))
            curves[name] = [(v, sum(xs) / len(xs)) for v, xs in sorted(by_version.items())]
        out[eta] = curves
    return out


WARMUP_STEPS = 2  # the first steps pay for compilation, cache warm-up and the first weight update


def curve_from_rows(rows: list[dict]) -> list[list]:
    """[[version, sampled, greedy], ...] from metrics.jsonl: eval rows are keyed to the policy
    version they measured (eval/version, eval/greedy_version), not to the step they arrived at."""
    points: dict[int, list] = {}
    for r in rows:
        for slot, key, version_key in (
            (0, "eval/pass@1", "eval/version"),
            (1, "eval/greedy", "eval/greedy_version"),
        ):
            if key in r:
                points.setdefault(int(r.get(version_key, r["step"])), [None, None])[slot] = r[key]
    return [[v, s, g] for v, (s, g) in sorted(points.items())]


def tokens_per_s(rows: list[dict]) -> float | None:
    """Trained tokens per second of step wall time, the warm-up steps left out (all steps when
    the run is shorter than that): sum(train/num_tokens) / sum(time/step_s)."""
    steps = [r for r in rows if "time/step_s" in r and "train/num_tokens" in r]
    if len(steps) > WARMUP_STEPS:
        steps = steps[WARMUP_STEPS:]
    wall = sum(r["time/step_s"] for r in steps)
    return sum(r["train/num_tokens"] for r in steps) / wall if wall > 0 else None
