"""Issue 42, item 4: `algo.max_staleness=auto` against fixed bounds 0, 2 and 8, paired by seed.

    python -m bench.staleness.auto_eta run --seeds 1,2,3 --lr 1.5e-4        # 4 arms x 3 seeds (~2.4 h here)
    python -m bench.staleness.auto_eta run --seeds 1,2 --lr 3e-4 rollout.num_servers=3 \
        --run-root runs/auto_eta_srv3 --out bench/staleness/results/auto_eta_srv3   # generation ahead (~1 h)
    python -m bench.staleness.auto_eta run --seeds 1,2,3 --reuse             # go on after --budget-h stopped it
    python -m bench.staleness.auto_eta table                                 # re-aggregate, start nothing

Every run is one `python -m launch.local experiment=countdown` with algo.max_staleness = 0, 2, 8
or auto (ceiling algo.staleness_ceiling, 8 by default), trainer.lr, algo.ppo_minibatches,
trainer.seed and data.seed = the seed (the arms of one seed share prompts and sampling seed; the
pairs differ in data order). Unlike `make ablate` nothing fixes the delay: the realised staleness
is what admission gives, so the table reports it per arm; a fixed 8 only tests the law where the
generation runs ahead of the trainer (realised staleness near 8: check `staleness mean` of
fixed8, and add `key=value` overrides that slow the trainer or speed the rollout if it is not).
Outcomes: held-out sampled / greedy accuracy at the end (summary.json) and the run's wall time;
per arm the mean, and auto minus each fixed arm paired by seed (mean, t interval, pairs won).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import held_flock
from bench.staleness.ablate import DEFAULTS, RUN_TIMEOUT_S, shown_run_dir
from bench.staleness.ablation_table import mean_sd, sign_test_p, t_interval

REPO = Path(__file__).resolve().parents[2]
ARMS = {"fixed0": "0", "fixed2": "2", "fixed8": "8", "auto": "auto"}
OUTCOMES = ("sampled_end", "greedy_end", "wall_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.staleness.auto_eta", description=__doc__.split("\n")[0])
    p.add_argument("command", choices=("run", "table"))
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {','.join(ARMS)}")
    p.add_argument("--seeds", default="1,2,3", help="trainer.seed = data.seed values, paired across arms")
    p.add_argument("--lr", type=float, default=1.5e-4, help="trainer.lr (fixed 8 lost to 0 at 1.5e-4)")
    p.add_argument("--minibatches", type=int, default=4, help="algo.ppo_minibatches")
    p.add_argument("--steps", type=int, default=60, help="trainer.total_steps")
    p.add_argument("--run-root", type=Path, default=REPO / "runs" / "auto_eta")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "staleness" / "results" / "auto_eta")
    p.add_argument("--reuse", action="store_true", help="take runs that already finished")
    p.add_argument("--budget-h", type=float, default=0.0, help="start no run after this many hours")
    p.add_argument("--lock", type=Path, default=None, help="flock file shared with other heavy jobs")
    p.add_argument("overrides", nargs="*", help="launch.local overrides for every run")
    args = p.parse_intermixed_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown:
        p.error(f"unknown arms {unknown}; choose from {sorted(ARMS)}")
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    return args


def run_name(arm: str, args: argparse.Namespace, seed: int) -> str:
    return f"{arm}-lr{args.lr:g}-mb{args.minibatches}-s{seed}-n{args.steps}"


def launch_cmd(arm: str, args: argparse.Namespace, seed: int) -> list[str]:
    settings = {
        **DEFAULTS,
        "run.name": run_name(arm, args, seed),
        "run.root": str(args.run_root),
        "algo.max_staleness": ARMS[arm],
        "trainer.lr": str(args.lr),
        "algo.ppo_minibatches": str(args.minibatches),
        "trainer.seed": str(seed),
        "data.seed": str(seed),
        "trainer.total_steps": str(args.steps),
    }
    for item in args.overrides:  # the caller's overrides replace the defaults of the same key
        key, _, value = item.partition("=")
        settings[key] = value
    return [sys.executable, "-m", "launch.local", *(f"{k}={v}" for k, v in settings.items())]


def read_record(run_dir: Path, arm: str, seed: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r for r in rows if "train/version" in r]

    def mean_of(key: str) -> float | None:
        stat = mean_sd([r[key] for r in steps if key in r])
        return stat["mean"] if stat else None

    return {
        "arm": arm, "seed": seed, "run_dir": shown_run_dir(run_dir), "wall_s": summary.get("wall_s"),
        "sampled_end": summary.get("accuracy_end"), "greedy_end": summary.get("greedy_accuracy_end"),
        "sampled_start": summary.get("accuracy_start"), "staleness_mean": mean_of("staleness/mean"),
        "bound_mean": mean_of("staleness/bound"), "preclip_mean": mean_of("offpolicy/preclip_fraction"),
        "bounds": [r["staleness/bound"] for r in steps if "staleness/bound" in r],
    }  # fmt: skip


def finished(run_dir: Path, steps: int) -> bool:
    summary = run_dir / "summary.json"
    return summary.exists() and json.loads(summary.read_text()).get("steps") == steps


def summarise(records: list[dict], arms: list[str]) -> dict:
    """Per arm: mean ± sd of each outcome and of the mechanism; auto - each fixed arm paired by seed."""
    by = {(r["arm"], r["seed"]): r for r in records if "error" not in r}
    out: dict = {"arms": {}, "paired": {}}
    for arm in arms:
        runs = [r for (a, _), r in by.items() if a == arm]
        keys = (*OUTCOMES, "staleness_mean", "bound_mean", "preclip_mean")
        out["arms"][arm] = {k: mean_sd([r[k] for r in runs if r.get(k) is not None]) for k in keys}
    for arm in arms:
        if arm == "auto" or "auto" not in arms:
            continue
        seeds = sorted(s for (a, s) in by if a == "auto" and ("auto", s) in by and (arm, s) in by)
        pair: dict = {"seeds": seeds}
        for k in OUTCOMES:
            diffs = [by[("auto", s)][k] - by[(arm, s)][k] for s in seeds]
            pair[k] = {"diffs": diffs, "stat": mean_sd(diffs), "t": t_interval(diffs),
                       "auto_higher": sum(d > 0 for d in diffs), "sign_p": sign_test_p(diffs)}  # fmt: skip
        out["paired"][arm] = pair
    return out


def _ms(stat: dict | None, digits: int = 3) -> str:
    if not stat:
        return "-"
    return f"{stat['mean']:.{digits}f}" + (f" ± {stat['sd']:.{digits}f}" if stat["n"] > 1 else "")


def markdown(summary: dict) -> str:
    lines = [
        "| arm | runs | sampled end | greedy end | wall s | staleness mean | bound mean | pre-clipped |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, s in summary["arms"].items():
        n = (s["wall_s"] or {}).get("n", 0)
        lines.append(
            f"| {arm} | {n} | {_ms(s['sampled_end'])} | {_ms(s['greedy_end'])} | {_ms(s['wall_s'], 0)} "
            f"| {_ms(s['staleness_mean'], 2)} | {_ms(s['bound_mean'], 2)} | {_ms(s['preclip_mean'])} |"
        )
    lines += ["", "| auto - | pairs | sampled [t 95%] (auto higher) | greedy [t 95%] | wall s [t 95%] |",
              "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for arm, p in summary["paired"].items():
        cells = []
        for k, digits in (("sampled_end", 3), ("greedy_end", 3), ("wall_s", 0)):
            d = p[k]
            t = f" [{d['t'][0]:+.{digits}f}, {d['t'][1]:+.{digits}f}]" if d["t"] else ""
            mean = f"{d['stat']['mean']:+.{digits}f}" if d["stat"] else "-"
            cells.append(f"{mean}{t} ({d['auto_higher']}/{len(p['seeds'])})")
        lines.append(f"| {arm} | {len(p['seeds'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    records, t0 = [], time.monotonic()
    for seed in args.seeds:
        for arm in args.arms:
            run_dir = args.run_root / run_name(arm, args, seed)
            if finished(run_dir, args.steps) and (args.reuse or args.command == "table"):
                records.append(read_record(run_dir, arm, seed))
                continue
            if args.command == "table":
                continue
            if args.budget_h and time.monotonic() - t0 > args.budget_h * 3600:
                print(f"budget of {args.budget_h} h spent: run again with --reuse", file=sys.stderr)
                return 2
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            with held_flock(args.lock, 5.0):
                done = subprocess.run(launch_cmd(arm, args, seed), cwd=REPO, env=env, timeout=RUN_TIMEOUT_S,
                                      capture_output=True, text=True)  # fmt: skip
            if done.returncode != 0 or not finished(run_dir, args.steps):
                records.append({"arm": arm, "seed": seed, "error": done.stderr[-1500:]})
                print(f"{arm} seed {seed} failed: {done.stderr[-500:]}", file=sys.stderr)
                continue
            records.append(read_record(run_dir, arm, seed))
            write(args, records)
    print(write(args, records))
    return 0


def write(args: argparse.Namespace, records: list[dict]) -> str:
    summary = summarise(records, args.arms)
    text = markdown(summary)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "auto_eta.md").write_text(text + "\n")
    (args.out / "auto_eta.json").write_text(json.dumps({"summary": summary, "runs": records}, indent=2))
    return text


if __name__ == "__main__":
    sys.exit(main())
