"""`make ablate`: where does staleness bite? Naive vs decoupled PPO at exact delays, on countdown.

One command per table (bench/README.md, "Where staleness bites"):

    python -m bench.staleness.ablation_probe                 # first, no servers: gradient cosines per delay
    python -m bench.staleness.ablate calibrate               # pre-clipped share per lr x delay (calibration.md)
    python -m bench.staleness.ablate pilot --lr 3e-4         # 3 paired seeds at delay 8 (pilot.md)
    python -m bench.staleness.ablate run --lr 3e-4 --seeds 1,2,3,4,5,6,7,8   # the ablation (ablation.md/png)
    python -m bench.staleness.ablate table                   # re-aggregate every finished run, start no new one

Every run is one `python -m launch.local experiment=countdown` (as `make run EXP=countdown`) with
algo.exact_delay = algo.max_staleness = d (every batch trains samples exactly d versions old,
from step d on), one arm (naive: algo.decoupled=false; decoupled: the behaviour weight capped at
5; decoupled_nocap: no cap; issue 42's objectives icepop, m2po, m2po_areal, prime, cispo and
decoupled_ess: bench/staleness/ablation_table.py ARM_OVERRIDES), trainer.lr, algo.ppo_minibatches and
trainer.seed. data.seed (the prompt order) was never varied before issue 42, so every pair shared
one prompt order; --data-seed-follows-seed sets data.seed = trainer.seed (default: on when --arms
names an issue-42 arm, so naive runs beside them with the same seeds and order; off otherwise,
so the existing runs are found again under --reuse). Either way seeds pair across arms; the run
names (suffix -ds), the records (data_seed) and the tables (cells ".../ds", column "prompts")
tell the two apart.

    python -m bench.staleness.ablate run --arms naive,icepop,m2po,m2po_areal,prime,cispo,decoupled_ess \
        --lr 1.5e-4 --delays 8 --seeds 1,2,3        # issue 42: 3 pairs per arm at delay 8 From each run it reads summary.json (held-out accuracy at start
and end) and metrics.jsonl (training reward per step, offpolicy/* per step). `--reuse` takes runs
that already finished in --run-root; `--budget-h H` starts no run after H hours (exit code 2:
run the same command with --reuse to go on), so each part fits a window. Every command writes
its outputs after each run; `key=value` arguments are launch.local overrides for every run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import held_flock
from bench.staleness.ablation_table import (
    ARM_OVERRIDES,
    ARMS,
    NEW_ARMS,
    ablation_markdown,
    ablation_summary,
    calibration_markdown,
    calibration_table,
    cell_name,
    paired_differences,
    pairs_needed,
    pooled_all,
    record_from_rows,
)

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 3 * 3600
LOCK_YIELD_S = 5.0  # after each run, time for another job waiting on the lock to take it
# set per run by the ablation itself: an override of one of these is refused
VARIED = ("run.name", "run.root", "algo.max_staleness", "algo.exact_delay", "algo.decoupled",
          "algo.behav_weight_cap", "trainer.seed", "trainer.total_steps", "trainer.lr",
          "algo.ppo_minibatches", "algo.objective", "algo.ess_step", "data.seed")  # fmt: skip
# every run's settings unless an override of the same key replaces them: the countdown task,
# held-out evaluation at the start and the end only (the reward curve is per step anyway)
DEFAULTS = {
    "experiment": "countdown",
    "run.eval_every_steps": "0",
    "run.tensorboard": "false",
    "checkpoint.resume": "false",
    "checkpoint.every_steps": "0",
}
COMMANDS = {
    # command: (arms, delays, seeds) defaults. Measured on countdown at 60 steps (bench/README.md):
    # pre-clipped 9-14% at delay 8, 37% at 16 where every decoupled run collapsed; the pilot sits
    # at 8, the ablation spans 0-8
    "calibrate": ("decoupled", "0,8,16,32", "1"),
    "pilot": ("naive,decoupled", "8", "1,2,3"),
    "run": ("naive,decoupled,decoupled_nocap", "0,2,4,8", "1,2,3,4,5,6,7,8"),
    "table": ("naive,decoupled,decoupled_nocap", "0,2,4,8", "1,2,3,4,5,6,7,8"),
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.staleness.ablate", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=list(COMMANDS))
    p.add_argument("--arms", default=None, help=f"comma-separated, of {','.join(ARMS)}")
    p.add_argument("--delays", type=_ints, default=None, help="algo.exact_delay values")
    p.add_argument("--seeds", type=_ints, default=None, help="trainer.seed values (paired across arms)")
    p.add_argument(
        "--lrs",
        "--lr",
        type=_floats,
        default=None,
        help="trainer.lr values (calibrate: 1.5e-4,3e-4; else 3e-4)",
    )
    p.add_argument("--minibatches", type=_ints, default=[4], help="algo.ppo_minibatches values")
    p.add_argument("--steps", type=int, default=60, help="trainer.total_steps of every run")
    p.add_argument(
        "--nocap-delays",
        type=_ints,
        default=None,
        help="delays at which decoupled_nocap runs (default: the largest only; the probe saw the cap act nowhere else)",
    )
    p.add_argument(
        "--data-seed-follows-seed",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="data.seed = trainer.seed (prompt order varies with the pair); default: on when --arms has an "
        f"issue-42 arm ({','.join(NEW_ARMS)}), else off (data.seed 1, as every run before)",
    )
    p.add_argument(
        "--all-arms-at-0",
        action="store_true",
        help="run every arm at delay 0 (default: one, the objectives coincide there)",
    )
    p.add_argument("--effect", type=float, default=0.05, help="pilot: the difference to resolve")
    p.add_argument(
        "--out",
        type=Path,
        default=REPO / "bench" / "staleness" / "results",
        help="where the tables and the figure go",
    )
    p.add_argument("--run-root", type=Path, default=REPO / "runs" / "ablate", help="run directories")
    p.add_argument("--reuse", action="store_true", help="take runs that already finished in --run-root")
    p.add_argument("--budget-h", type=float, default=0.0, help="start no run after this many hours (0: none)")
    p.add_argument("--lock", type=Path, default=None, help="hold this flock during each run (shared machine)")
    p.add_argument("overrides", nargs="*", help="launch.local overrides for every run (key=value)")
    args = p.parse_intermixed_args(argv)  # overrides may follow options
    arms, delays, seeds = COMMANDS[args.command]
    args.arms = [a.strip() for a in (args.arms or arms).split(",") if a.strip()]
    args.delays = args.delays if args.delays is not None else _ints(delays)
    args.seeds = args.seeds if args.seeds is not None else _ints(seeds)
    if args.data_seed_follows_seed is None:
        args.data_seed_follows_seed = any(a in NEW_ARMS for a in args.arms)
    if args.nocap_delays is None:
        args.nocap_delays = [max(args.delays)] if args.delays else []
    if args.lrs is None:
        # countdown's warm start learns at 1.5e-4 and 3e-4 and breaks within 40 steps at 6e-4
        args.lrs = [1.5e-4, 3e-4] if args.command == "calibrate" else [3e-4]
    if set(args.arms) - set(ARMS) or not args.arms:
        p.error(f"--arms: choose from {','.join(ARMS)} (got {args.arms})")
    if args.steps < 1 or not args.delays or not args.seeds or min(args.delays) < 0:
        p.error("--steps >= 1, --delays (each >= 0) and --seeds must be non-empty")
    if args.command == "pilot" and "naive" not in args.arms:
        p.error("the pilot pairs each arm with naive: include naive in --arms")
    for o in args.overrides:
        if "=" not in o:
            p.error(f"override {o!r} is not key=value")
        if o.split("=", 1)[0].lstrip("+") in VARIED:
            p.error(f"{o!r}: the ablation sets {', '.join(VARIED)} itself (its options)")
    given = {o.split("=", 1)[0].lstrip("+") for o in args.overrides}
    args.overrides = [f"{k}={v}" for k, v in DEFAULTS.items() if k not in given] + args.overrides
    return args


def arms_at(args: argparse.Namespace, delay: int) -> list[str]:
    """The arms that run at `delay`. At delay 0 every sample is on-policy: p = b up to the
    server/trainer log-prob mismatch, so naive and decoupled PPO are one objective and one run
    per seed (the first decoupled arm; --all-arms-at-0 runs them all) is the cell's reference.
    decoupled_nocap differs from decoupled only where the behaviour weight passes the cap (5):
    in the probe the two gradients' cosine was 1.000 everywhere but lr 1e-3 at delay 8 (0.956),
    so it runs at --nocap-delays (the largest delay by default)."""
    arms = [a for a in args.arms if a != "decoupled_nocap" or delay in args.nocap_delays]
    if delay == 0 and not args.all_arms_at_0:
        old = [a for a in arms if a not in NEW_ARMS]
        reference = ([a for a in old if a != "naive"] or old)[:1]
        new = [a for a in arms if a in NEW_ARMS]
        # issue 42's objectives are not PPO on fresh data (prime's KL, CISPO's REINFORCE, M2PO's
        # missing ε-clip): each runs at delay 0 too, against naive (what they cost on fresh data)
        return (["naive"] if new and "naive" in arms else reference) + new
    return arms


def plan(args: argparse.Namespace) -> list[dict]:
    """Every run of the command, seed-major (a part cut short holds whole pairs of its first
    seeds), then lr, minibatches, delay, arm."""
    return [
        {"arm": arm, "lr": lr, "minibatches": mb, "delay": d, "seed": seed, "steps": args.steps,
         "data_seed": seed if args.data_seed_follows_seed else None}
        for seed in args.seeds for lr in args.lrs for mb in args.minibatches for d in args.delays
        for arm in arms_at(args, d)
    ]  # fmt: skip


# measured on the 2-core machine: countdown's two held-out evaluations and start-up ~105 s, a
# step ~6.5 s (make run EXP=countdown: 40 steps in 318-339 s)
RUN_FIXED_S, STEP_S = 105.0, 6.5


def estimated_hours(cells: list[dict]) -> float:
    return sum(RUN_FIXED_S + STEP_S * c["steps"] for c in cells) / 3600


def run_name(cell: dict) -> str:
    name = f"{cell['arm']}-lr{cell['lr']:g}-mb{cell['minibatches']}-d{cell['delay']}-s{cell['seed']}-n{cell['steps']}"
    return name + ("-ds" if cell.get("data_seed") is not None else "")  # prompts follow the seed


def launch_cmd(args: argparse.Namespace, cell: dict) -> list[str]:
    return [
        sys.executable, "-m", "launch.local", f"run.name={run_name(cell)}", f"run.root={args.run_root}",
        f"algo.exact_delay={cell['delay']}", f"algo.max_staleness={cell['delay']}",
        *ARM_OVERRIDES[cell["arm"]], f"trainer.lr={cell['lr']}", f"algo.ppo_minibatches={cell['minibatches']}",
        f"trainer.seed={cell['seed']}", f"trainer.total_steps={cell['steps']}",
        *([f"data.seed={cell['data_seed']}"] if cell.get("data_seed") is not None else []), *args.overrides,
    ]  # fmt: skip


def shown_run_dir(run_dir: Path) -> str:
    """The run directory as the committed JSON records it: relative to the repository (runs/ablate/
    <name> under the default --run-root), else <run-root's name>/<name>, never a machine's absolute
    path, so re-aggregating the same runs elsewhere writes the same file."""
    resolved = run_dir.resolve()
    if resolved.is_relative_to(REPO):
        return resolved.relative_to(REPO).as_posix()
    return f"{resolved.parent.name}/{resolved.name}"


def read_record(run_dir: Path, cell: dict) -> dict:
    """The run's record (bench/staleness/ablation_table.py) from its summary.json and metrics.jsonl."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {
        **cell,
        "run_dir": shown_run_dir(run_dir),
        "wall_s": summary.get("wall_s"),
        "greedy_start": summary.get("greedy_accuracy_start"),
        "greedy_end": summary.get("greedy_accuracy_end"),
        "sampled_start": summary.get("accuracy_start"),
        "sampled_end": summary.get("accuracy_end"),
        "max_staleness_seen": summary.get("max_staleness_seen"),
        **record_from_rows(rows, cell["delay"]),
    }


def finished(run_dir: Path, steps: int) -> bool:
    summary = run_dir / "summary.json"
    return summary.exists() and json.loads(summary.read_text()).get("steps") == steps


def run_one(args: argparse.Namespace, cell: dict) -> dict:
    """One launch.local run (or its finished directory under --reuse): its record, or one with "error"."""
    run_dir = args.run_root / run_name(cell)
    if args.reuse and finished(run_dir, cell["steps"]):
        return {**read_record(run_dir, cell), "reused": True}
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with held_flock(args.lock, LOCK_YIELD_S):
        t0 = time.monotonic()
        result = subprocess.run(
            launch_cmd(args, cell), cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env
        )
        wall = round(time.monotonic() - t0, 1)
    if result.returncode != 0 or not finished(run_dir, cell["steps"]):
        return {**cell, "run_dir": shown_run_dir(run_dir), "wall_s": wall,
                "error": f"launch.local exit {result.returncode}: {result.stderr[-1500:]}"}  # fmt: skip
    (run_dir / "cell.json").write_text(json.dumps(cell))
    return {**read_record(run_dir, cell), "launch_wall_s": wall}


def collect(run_root: Path) -> list[dict]:
    """`table`: every finished run under run_root that an ablation command started (cell.json)."""
    records = []
    for cell_file in sorted(run_root.glob("*/cell.json")):
        cell = json.loads(cell_file.read_text())
        if finished(cell_file.parent, cell["steps"]):
            records.append(read_record(cell_file.parent, cell))
    return records


def write_outputs(args: argparse.Namespace, runs: list[dict]) -> str:
    """The command's table(s), after every run: an interrupted part keeps what it measured."""
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {"command": args.command, "arms": args.arms, "lrs": args.lrs, "minibatches": args.minibatches,
                "delays": args.delays, "seeds": args.seeds, "steps": args.steps, "overrides": args.overrides,
                "data_seed_follows_seed": args.data_seed_follows_seed}  # fmt: skip
    if args.command == "calibrate":
        table = calibration_table(runs)
        text = calibration_markdown(table)
        (args.out / "calibration.json").write_text(
            json.dumps({"settings": settings, "table": table, "runs": runs}, indent=2)
        )
        (args.out / "calibration.md").write_text(text + "\n")
        return text
    cells = ablation_summary(runs)
    pooled = pooled_all(cells)  # bootstraps: computed once for the markdown and the json
    text = ablation_markdown(cells, pooled)
    name = "pilot" if args.command == "pilot" else "ablation"
    if args.command == "pilot":
        text += "\n\n" + pilot_markdown(runs, args.arms, args.effect)
    (args.out / f"{name}.json").write_text(
        json.dumps(
            {"settings": settings, "cells": cells, "pooled": pooled, "runs": runs},
            indent=2,
            default=list,
        )
    )
    (args.out / f"{name}.md").write_text(text + "\n")
    return text


def pilot_markdown(runs: list[dict], arms: list[str], effect: float) -> str:
    """The spread of the per-seed differences and the pairs it takes to resolve a difference the
    size of that spread, and of `effect`."""
    lines = ["| cell (lr/mb/delay) | comparison | outcome | pairs | sd of the differences | pairs for sd | "
             f"pairs for {effect:g} |", "|" + " --- |" * 7]  # fmt: skip
    for arm in [a for a in arms if a != "naive"]:
        for outcome in ("sampled_end", "greedy_end", "reward_auc"):
            for cell, d in paired_differences(runs, arm, outcome).items():
                sd = d.get("sd", 0.0)
                lines.append(
                    f"| {cell_name(cell)} | {arm} - naive | {outcome} | {d['n']} | {sd:.4f} | "
                    f"{pairs_needed(sd, sd) if sd > 0 else '-'} | {pairs_needed(sd, effect) if sd > 0 else '-'} |"
                )
    return "\n".join(lines)


def plot(cells: dict, path: Path) -> Path | None:
    """The headline figure: each arm - naive in final held-out accuracy (left) and in training
    reward AUC (right) against the arm's own pre-clipped share in that cell (how far its policy
    drifted from the data; the cell's pooled share put every arm of a cell on one vertical line),
    one point per cell, with the paired t 95% intervals (wider than the bootstrap's at few pairs);
    one series per arm that has pairs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot written", file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    arms = [a for a in ARMS[1:] if any(c["paired"][f"{a}-naive"]["sampled_end"] for c in cells.values())]
    markers, colours = "osD^v<>ph", plt.get_cmap("tab10").colors
    for ax, outcome, label in ((axes[0], "sampled_end", "final held-out accuracy (sampled)"),
                               (axes[1], "reward_auc", "training reward AUC (mean reward per step)")):  # fmt: skip
        for i, arm in enumerate(arms):
            key, marker, colour, name = f"{arm}-naive", markers[i % 9], colours[i % 10], f"{arm} - naive"
            xs, ys, lo, hi, tags = [], [], [], [], []
            for c in cells.values():
                own = c.get("arms", {}).get(arm, {}).get("mechanism", {}).get("preclip")
                d, share = c["paired"][key][outcome], own or c["mechanism"]["preclip"]
                if d is None or share is None:
                    continue
                ci = d["t95"] or d["ci95"] or (d["mean"], d["mean"])  # t: wider at few pairs
                xs.append(share["mean"])
                ys.append(d["mean"])
                lo.append(d["mean"] - ci[0])
                hi.append(ci[1] - d["mean"])
                prompts = ", prompts by seed" if c.get("data_follows_seed") else ""
                tags.append(
                    f"lr {c['lr']:g}, d {c['delay']}, {d['n']} pair{'s' if d['n'] > 1 else ''}{prompts}"
                )
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt=marker, color=colour, capsize=3, label=name)
                if len(cells) == 1:  # one cell: its description is the title, not a label per point
                    continue
                # cells at the same share (lr 3e-4, delays 4 and 8) would print over each other:
                # the first arm's labels alternate up and down, the others' go left, at a height
                # of their own
                right = i == 0
                for j, (x, y, t) in enumerate(zip(xs, ys, tags, strict=True)):
                    offset = (6, 4 if j % 2 == 0 else -10) if right else (-6, 8 + 10 * (i - 1))
                    ax.annotate(t, (x, y), fontsize=7, xytext=offset, textcoords="offset points",
                                ha="left" if right else "right")  # fmt: skip
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xlabel("the arm's pre-clipped share of tokens (offpolicy/preclip_fraction)")
        ax.set_ylabel(f"difference in {label}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    title = "each objective vs naive PPO on countdown: paired by seed, 95% t intervals"
    if len(cells) == 1:
        (c,) = cells.values()
        prompts = ", prompts by seed" if c.get("data_follows_seed") else ""
        title += f"\nlr {c['lr']:g}, {c['minibatches']} minibatches, samples exactly {c['delay']} versions old{prompts}"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    if args.command == "table":
        runs = collect(args.run_root)
        text = write_outputs(args, runs)
        png = plot(ablation_summary(runs), args.out / "ablation.png")
        print(text)
        print(f"{len(runs)} runs from {args.run_root}" + (f"; wrote {png}" if png else ""))
        return 0
    todo, runs, stopped = plan(args), [], False
    print(f"{len(todo)} runs, about {estimated_hours(todo):.1f} h on 2 cores (without --reuse)", flush=True)
    for i, cell in enumerate(todo, 1):
        elapsed_h = (time.monotonic() - t_start) / 3600
        if (
            args.budget_h
            and elapsed_h > args.budget_h
            and not (args.reuse and finished(args.run_root / run_name(cell), cell["steps"]))
        ):
            stopped = True
            continue  # finished runs are still collected below; unfinished ones wait for the next part
        print(f"[{i}/{len(todo)}] {run_name(cell)} ...", flush=True)
        record = run_one(args, cell)
        runs.append(record)
        if "error" in record:
            print(f"  FAILED after {record['wall_s']} s: {record['error'][-600:]}", flush=True)
        else:
            print(
                f"  sampled {record['sampled_start']:.3f} -> {record['sampled_end']:.3f}, greedy "
                f"{record['greedy_start']:.3f} -> {record['greedy_end']:.3f}, reward AUC {record['reward_auc']:.3f}, "
                f"pre-clipped {_pct(record['preclip'])}, {record['wall_s']} s (elapsed {time.monotonic() - t_start:.0f} s)",
                flush=True,
            )
        write_outputs(args, runs)
    text = write_outputs(args, runs)
    if args.command in ("run", "pilot"):
        png = plot(
            ablation_summary(runs), args.out / f"{'pilot' if args.command == 'pilot' else 'ablation'}.png"
        )
        if png:
            print(f"wrote {png}")
    print(text)
    print(f"wall clock {time.monotonic() - t_start:.0f} s for {len(runs)} runs")
    if stopped:
        print(f"--budget-h {args.budget_h} reached: run the same command with --reuse to go on")
        return 2
    return 1 if any("error" in r for r in runs) else 0


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


if __name__ == "__main__":
    sys.exit(main())
