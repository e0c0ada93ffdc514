"""The staleness ablation's pure half: run records -> calibration table, paired differences with
bootstrap intervals, the pilot's pair count, markdown.

A run record (what bench/staleness/ablate.py reads back from one launch.local run) is a dict:
  arm (ARMS), lr, minibatches, delay, seed, data_seed (the run's data.seed when it followed
  trainer.seed; absent or None: the fixed prompt order of every run before issue 42),
  greedy_start/end, sampled_start/end (held-out accuracy), reward_auc (mean training reward over
  the steps), preclip, preclip_cut, k3_kl, abs_log_w_p99, ess, clip_fraction (means over the steps at
  the full delay: offpolicy/* and ppo/clip_fraction), wall_s.
Failed runs carry "error" and are left out (the tables say how many seeds they used).

A cell is (lr, minibatches, delay, data order). Arms are paired by seed: the same trainer.seed
and the same prompt order for every arm, so a paired difference removes what the seed does to
both. The runs before issue 42 all share one prompt order (data.seed 1, "fixed"); new ones set
data.seed = trainer.seed ("seed": the pairs then differ in prompts too), and form cells of their
own (key suffix "/ds"), paired only with naive runs of the same order.
"""

from __future__ import annotations

import math
import random

ARMS = ("naive", "decoupled", "decoupled_nocap", "icepop", "m2po", "m2po_areal", "prime", "cispo",
        "decoupled_ess")  # fmt: skip
# issue 42's arms: their runs vary the prompt order with the seed by default (bench/staleness/ablate.py)
NEW_ARMS = ARMS[3:]
# how each arm sets the objective (launch.local overrides; docs/objective.md has each objective).
# The arms on π_p keep the decoupled arm's behaviour-weight cap 5 (AReaL's setting) under their own
# mask, except icepop, whose band [0.5, 5] already cuts at 5
ARM_OVERRIDES = {
    "naive": ("algo.decoupled=false",),
    "decoupled": ("algo.decoupled=true", "algo.behav_weight_cap=5"),
    "decoupled_nocap": ("algo.decoupled=true", "algo.behav_weight_cap=0"),
    "icepop": ("algo.objective=icepop", "algo.behav_weight_cap=0"),
    "m2po": ("algo.objective=m2po",),
    "m2po_areal": ("algo.objective=m2po_areal", "algo.behav_weight_cap=5"),
    "prime": ("algo.objective=prime",),
    "cispo": ("algo.objective=cispo",),
    # VCPO-style: the decoupled arm with each step's lr times sqrt(ESS of π_θ/π_b)
    "decoupled_ess": ("algo.decoupled=true", "algo.behav_weight_cap=5", "algo.ess_step=sqrt"),
}
OUTCOMES = ("greedy_end", "sampled_end", "reward_auc")
MECHANISM = ("preclip", "preclip_cut", "k3_kl", "abs_log_w_p99", "ess", "clip_fraction")
BOOTSTRAP_RESAMPLES = 10_000
# a run whose held-out sampled accuracy ends below this has collapsed (countdown starts at 0.36-0.41;
# the collapsed runs seen end at 0.000: answers that no longer parse)
COLLAPSED_BELOW = 0.05
# pairs for 80% power at a two-sided 5% level: (1.96 + 0.84)^2 = 7.85 x (spread / effect)^2
POWER_FACTOR = 7.85


def cell_key(r: dict) -> tuple[float, int, int, int]:
    """(lr, minibatches, delay, 1 when the prompt order followed the seed else 0)."""
    return (float(r["lr"]), int(r["minibatches"]), int(r["delay"]), int(r.get("data_seed") is not None))


def cell_name(cell: tuple) -> str:
    """ "lr/minibatches/delay", with "/ds" when the prompt order followed the seed."""
    return "/".join(f"{x:g}" for x in cell[:3]) + ("/ds" if cell[3] else "")


def mean_sd(values: list[float]) -> dict[str, float] | None:
    """Mean, sample standard deviation (n - 1; 0 for one value) and n of the finite values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return None
    mean = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return {"mean": mean, "sd": sd, "n": len(xs)}


def bootstrap_ci(values: list[float], level: float = 0.95, seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean (BOOTSTRAP_RESAMPLES resamples with replacement,
    a fixed RNG seed: the same records give the same interval); None below two values."""
    xs = [float(v) for v in values]
    if len(xs) < 2:
        return None
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(xs, k=len(xs))) / len(xs) for _ in range(BOOTSTRAP_RESAMPLES))
    tail = (1 - level) / 2
    return means[int(tail * BOOTSTRAP_RESAMPLES)], means[
        min(int((1 - tail) * BOOTSTRAP_RESAMPLES), BOOTSTRAP_RESAMPLES - 1)
    ]


# Student's t at 0.975 by degrees of freedom (a df not listed takes the next smaller one: wider)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}  # fmt: skip


def t_interval(values: list[float]) -> tuple[float, float] | None:
    """The t interval of the mean (95%); None below two values. Beside the bootstrap because a
    percentile bootstrap of 3 pairs has 10 distinct resamples and covers far less than 95%."""
    stat = mean_sd(values)
    if stat is None or stat["n"] < 2:
        return None
    df = stat["n"] - 1
    t = T975[max(k for k in T975 if k <= df)]
    half = t * stat["sd"] / math.sqrt(stat["n"])
    return stat["mean"] - half, stat["mean"] + half


def ok_runs(runs: list[dict]) -> list[dict]:
    return [r for r in runs if "error" not in r]


def paired_differences(runs: list[dict], arm: str, outcome: str) -> dict[tuple, dict]:
    """Per cell: `arm` minus naive in `outcome`, seed by seed (seeds with both runs finished):
    the differences, their mean and sd, and the bootstrap 95% interval of the mean."""
    by = {(cell_key(r), r["arm"], r["seed"]): r for r in ok_runs(runs)}
    out: dict[tuple, dict] = {}
    for cell in sorted({cell_key(r) for r in ok_runs(runs)}):
        diffs, seeds = [], []
        for seed in sorted({s for (c, a, s) in by if c == cell and a == arm}):
            a, n = by.get((cell, arm, seed)), by.get((cell, "naive", seed))
            if a is None or n is None or a.get(outcome) is None or n.get(outcome) is None:
                continue
            diffs.append(float(a[outcome]) - float(n[outcome]))
            seeds.append(seed)
        if diffs:
            out[cell] = {
                "diffs": diffs,
                "seeds": seeds,
                **(mean_sd(diffs) or {}),
                "ci95": bootstrap_ci(diffs),
                "t95": t_interval(diffs),
            }
    return out


def mechanism_stats(chosen: list[dict]) -> dict[str, dict | None]:
    """Each mechanism statistic's mean ± sd over the chosen runs."""
    return {k: mean_sd([r.get(k) for r in chosen]) for k in MECHANISM}


def cell_mechanism(runs: list[dict]) -> dict[tuple, dict]:
    """Per cell: each mechanism statistic averaged over every arm's and seed's runs: the figure's
    x-axis, one number for the regime. The drift itself depends on the objective (countdown, lr
    3e-4, delay 8: pre-clipped 8.9-10.6% under naive, 8.7-14.3% under decoupled), so the tables
    also give it per arm (mechanism_markdown)."""
    out: dict[tuple, dict] = {}
    for cell in sorted({cell_key(r) for r in ok_runs(runs)}):
        out[cell] = mechanism_stats([r for r in ok_runs(runs) if cell_key(r) == cell])
    return out


def pairs_needed(sd: float, effect: float) -> int:
    """Seed pairs to detect a mean paired difference `effect` given the pilot's spread `sd`."""
    if effect <= 0:
        raise ValueError("effect must be > 0")
    return max(2, math.ceil(POWER_FACTOR * (sd / effect) ** 2))


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ms(stat: dict | None, digits: int = 3) -> str:
    if stat is None:
        return "-"
    return f"{stat['mean']:.{digits}f}" + (f" ± {stat['sd']:.{digits}f}" if stat["n"] > 1 else "")


def calibration_table(runs: list[dict]) -> dict:
    """Rows (lr, minibatches); per delay the mean pre-clipped share (and the share naive's clip
    cuts), and at delay 0 whether the policy learns (held-out sampled and greedy accuracy end -
    start, training reward AUC)."""
    rows: dict[str, dict] = {}
    runs = ok_runs(runs)
    for lr, mb in sorted({(float(r["lr"]), int(r["minibatches"])) for r in runs}):
        row: dict = {"lr": lr, "minibatches": mb, "delays": {}}
        for delay in sorted(
            {int(r["delay"]) for r in runs if float(r["lr"]) == lr and int(r["minibatches"]) == mb}
        ):
            chosen = [r for r in runs if cell_key(r)[:3] == (lr, mb, delay)]
            row["delays"][str(delay)] = {
                "preclip": mean_sd([r.get("preclip") for r in chosen]),
                "preclip_cut": mean_sd([r.get("preclip_cut") for r in chosen]),
                "abs_log_w_p99": mean_sd([r.get("abs_log_w_p99") for r in chosen]),
                "sampled_gain": mean_sd([_gain(r, "sampled") for r in chosen]),
                "greedy_gain": mean_sd([_gain(r, "greedy") for r in chosen]),
                "reward_auc": mean_sd([r.get("reward_auc") for r in chosen]),
                "runs": len(chosen),
            }
        rows[f"{lr:g}/{mb}"] = row
    return rows


def _gain(r: dict, kind: str) -> float | None:
    end, start = r.get(f"{kind}_end"), r.get(f"{kind}_start")
    return None if end is None or start is None else float(end) - float(start)


def calibration_markdown(table: dict) -> str:
    delays = sorted({int(d) for row in table.values() for d in row["delays"]})
    head = ["lr", "minibatches"] + [f"pre-clipped (cut) d={d}" for d in delays]
    head += [f"\\|log w\\| p99 d={delays[-1]}", "d=0: Δ sampled", "d=0: Δ greedy", "d=0: reward AUC"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in table.values():
        cells = [f"{row['lr']:g}", str(row["minibatches"])]
        for d in delays:
            c = row["delays"].get(str(d))
            cells.append("-" if c is None else f"{_ms(c['preclip'])} ({_ms(c['preclip_cut'])})")
        last, zero = row["delays"].get(str(delays[-1])), row["delays"].get("0")
        cells.append(_ms(last["abs_log_w_p99"]) if last else "-")
        cells += [_ms(zero[k]) if zero else "-" for k in ("sampled_gain", "greedy_gain", "reward_auc")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "pre-clipped: share of tokens whose w = π_pre / π_behav is outside [1 - ε, 1 + ε] at the step's "
        "start (offpolicy/preclip_fraction), mean over the steps at the full delay; in brackets the share "
        "naive PPO's clip cuts. Δ: held-out accuracy end - start. mean ± sd over the runs of a cell."
    )
    return "\n".join(lines)


def ablation_summary(runs: list[dict]) -> dict:
    """Everything the ablation table and figure show: per cell and arm the outcomes, the cell's
    mechanism statistics, and the paired differences of each decoupled arm against naive."""
    cells = {}
    mechanism = cell_mechanism(runs)
    # every cell's differences at once: once per arm and outcome, not once per cell as well
    paired = {(arm, o): paired_differences(runs, arm, o) for arm in ARMS[1:] for o in OUTCOMES}
    for cell in sorted({cell_key(r) for r in ok_runs(runs)}):
        arms = {}
        for arm in ARMS:
            chosen = [r for r in ok_runs(runs) if cell_key(r) == cell and r["arm"] == arm]
            if chosen:
                arms[arm] = {k: mean_sd([r.get(k) for r in chosen]) for k in OUTCOMES}
                arms[arm]["seeds"] = sorted(r["seed"] for r in chosen)
                arms[arm]["collapsed"] = sum(1 for r in chosen if collapsed(r))
                # per arm too: how far the policy drifts from the data depends on the objective
                arms[arm]["mechanism"] = mechanism_stats(chosen)
        diffs = {f"{arm}-naive": {o: paired[arm, o].get(cell) for o in OUTCOMES} for arm in ARMS[1:]}
        cells[cell_name(cell)] = {
            "lr": cell[0], "minibatches": cell[1], "delay": cell[2], "data_follows_seed": bool(cell[3]),
            "arms": arms, "mechanism": mechanism[cell], "paired": diffs,
        }  # fmt: skip
    return cells


def ablation_markdown(cells: dict, pooled: dict[str, dict[int, dict]] | None = None) -> str:
    """The tables of `ablation.md`: one row per cell and arm against naive (the arms that ran
    there); `pooled` (pooled_all) when the caller has it already."""
    head = ["lr", "mb", "delay", "prompts", "pre-clipped (cut)", "arm", "arm sampled", "naive sampled",
            "arm - naive: sampled [95% CI] (t interval)", "greedy [95% CI]", "reward AUC [95% CI]", "pairs",
            "collapsed: arm / naive"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in cells.values():
        mech = c["mechanism"]
        for arm in ARMS[1:]:
            if arm not in c["arms"]:
                continue
            d = c["paired"][f"{arm}-naive"]
            row = [f"{c['lr']:g}", str(c["minibatches"]), str(c["delay"]), _prompts(c),
                   f"{_ms(mech['preclip'])} ({_ms(mech['preclip_cut'])})", arm,
                   _ms(c["arms"][arm].get("sampled_end")), _ms(c["arms"].get("naive", {}).get("sampled_end"))]  # fmt: skip
            for outcome in ("sampled_end", "greedy_end", "reward_auc"):
                x = d[outcome]
                text = "-" if x is None else f"{x['mean']:+.3f} [{_ci(x['ci95'])}]"
                if x is not None and outcome == "sampled_end":
                    text += f" ({_ci(x['t95'])})"
                row.append(text)
            row.append(str(len(d["sampled_end"]["diffs"])) if d["sampled_end"] else "0")
            row.append(f"{_collapsed(c['arms'][arm])} / {_collapsed(c['arms'].get('naive'))}")
            lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append(
        "sampled / greedy: held-out accuracy at the end (mean ± sd over seeds); reward AUC: mean training "
        "reward over the steps. Differences are paired by seed (same trainer.seed and prompts), mean and "
        f"percentile-bootstrap 95% interval ({BOOTSTRAP_RESAMPLES} resamples; with few pairs it is too narrow, "
        "so the t interval is beside it for the sampled accuracy). prompts: fixed = one prompt order for "
        "every run (data.seed 1, the runs before issue 42), seed = data.seed follows trainer.seed. collapsed: "
        f"runs of the arm whose held-out sampled accuracy ended below {COLLAPSED_BELOW:g}, of its runs. "
        "pre-clipped: the cell's mean over every arm."
    )
    pooled = pooled_all(cells) if pooled is None else pooled
    lines += ["", "Pooled over learning rates, minibatch counts and prompt orders, per arm and delay "
              "(pairs of every cell):", ""]  # fmt: skip
    return "\n".join(lines + [pooled_markdown(pooled), "", mechanism_markdown(cells)])


def _prompts(c: dict) -> str:
    return "seed" if c.get("data_follows_seed") else "fixed"


def sign_test_p(diffs: list[float]) -> float | None:
    """Two-sided sign test: the chance of a split at least this lopsided if each pair's sign
    were a coin flip (ties left out); None without a non-zero difference."""
    signs = [d > 0 for d in diffs if d != 0]
    if not signs:
        return None
    n, k = len(signs), min(sum(signs), len(signs) - sum(signs))
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def pooled_by_delay(cells: dict, arm: str = "decoupled") -> dict[int, dict]:
    """Per delay: `arm` minus naive pooled over every lr and minibatch count that ran it, pair by
    pair (each pair is one seed of one cell; pairs of different cells are independent runs)."""
    out: dict[int, dict] = {}
    for delay in sorted({c["delay"] for c in cells.values()}):
        here = [
            c for c in cells.values() if c["delay"] == delay and c["paired"][f"{arm}-naive"]["sampled_end"]
        ]
        if not here:
            continue
        row: dict = {"lrs": sorted({c["lr"] for c in here})}
        for outcome in OUTCOMES:
            diffs = [d for c in here for d in (c["paired"][f"{arm}-naive"][outcome] or {}).get("diffs", [])]
            row[outcome] = {
                **(mean_sd(diffs) or {}),
                "negative": sum(1 for d in diffs if d < 0),
                "sign_p": sign_test_p(diffs),
                "ci95": bootstrap_ci(diffs),
                "t95": t_interval(diffs),
            }
        out[delay] = row
    return out


def pooled_all(cells: dict) -> dict[str, dict[int, dict]]:
    """pooled_by_delay for every arm with a pair: {arm: {delay: row}}."""
    out = {arm: pooled_by_delay(cells, arm) for arm in ARMS[1:]}
    return {arm: rows for arm, rows in out.items() if rows}


def _mean_t(stat: dict) -> str:
    return "-" if "mean" not in stat else f"{stat['mean']:+.3f} ({_ci(stat['t95'])})"


def pooled_markdown(pooled: dict) -> str:
    """pooled_all's {arm: {delay: row}} (or one arm's {delay: row}, read as decoupled's)."""
    if pooled and all(isinstance(k, int) for k in pooled):
        pooled = {"decoupled": pooled}
    if not pooled:
        return "(no seed pairs yet)"
    head = ["arm", "delay", "lrs", "pairs", "arm - naive: sampled [95% CI] (t interval)", "pairs negative (sign test p)",
            "greedy (t interval)", "reward AUC (t interval)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for arm, rows in pooled.items():
        for delay, row in rows.items():
            s = row["sampled_end"]
            p = "-" if s["sign_p"] is None else f"{s['sign_p']:.3g}"
            lines.append("| " + " | ".join([
                arm, str(delay), ", ".join(f"{lr:g}" for lr in row["lrs"]), str(s["n"]),
                f"{s['mean']:+.3f} [{_ci(s['ci95'])}] ({_ci(s['t95'])})", f"{s['negative']}/{s['n']} ({p})",
                *(_mean_t(row[o]) for o in ("greedy_end", "reward_auc")),
            ]) + " |")  # fmt: skip
    return "\n".join(lines)


def mechanism_markdown(cells: dict) -> str:
    """Per cell and arm: how far the policy moved from the data (offpolicy/*, means over the
    steps at the full delay, then over seeds) and how often the arm's clip acted."""
    head = ["lr", "mb", "delay", "arm", "runs", "collapsed", "pre-clipped", "cut by naive's clip",
            "k3 KL(behav, pre-step)", "\\|log w\\| p99", "ESS", "clip fraction"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in cells.values():
        for arm, a in c["arms"].items():
            m = a["mechanism"]
            delay = f"{c['delay']}" + (" (prompts by seed)" if c.get("data_follows_seed") else "")
            row = [f"{c['lr']:g}", str(c["minibatches"]), delay, arm, str(len(a["seeds"])),
                   str(a["collapsed"]), _ms(m["preclip"]), _ms(m["preclip_cut"]), _ms(m["k3_kl"]),
                   _ms(m["abs_log_w_p99"], 2), _ms(m["ess"]), _ms(m["clip_fraction"])]  # fmt: skip
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def collapsed(r: dict) -> bool:
    return r.get("sampled_end") is not None and float(r["sampled_end"]) < COLLAPSED_BELOW


def _collapsed(arm: dict | None) -> str:
    return "-" if arm is None else f"{arm['collapsed']}/{len(arm['seeds'])}"


def _ci(ci: tuple[float, float] | None) -> str:
    return "-" if ci is None else f"{ci[0]:+.3f}, {ci[1]:+.3f}"


def mean_after(rows: list[dict], key: str, first_step: int) -> float | None:
    """Mean of `key` over the metric rows with step >= first_step (None when none has it)."""
    xs = [r[key] for r in rows if key in r and r.get("step", 0) >= first_step]
    return sum(xs) / len(xs) if xs else None


def record_from_rows(rows: list[dict], delay: int) -> dict[str, float | None]:
    """The per-run statistics from metrics.jsonl: mechanism means over the steps at the full delay
    (step > delay: the ramp left out), the training reward's area under the curve (its mean over
    every step)."""
    train = [r for r in rows if "train/version" in r]
    first = delay + 1
    return {
        "reward_auc": mean_after(train, "reward/mean", 0),
        "preclip": mean_after(train, "offpolicy/preclip_fraction", first),
        "preclip_cut": mean_after(train, "offpolicy/preclip_cut_fraction", first),
        "k3_kl": mean_after(train, "offpolicy/k3_kl", first),
        "abs_log_w_p99": mean_after(train, "offpolicy/abs_log_w_p99", first),
        "ess": mean_after(train, "offpolicy/ess", first),
        "clip_fraction": mean_after(train, "ppo/clip_fraction", first),
        "steps_at_delay": float(
            sum(1 for r in train if r.get("staleness/min") == delay == r.get("staleness/max"))
        ),
    }
