"""`make ablate`: the paper's staleness ablation (Table 2) in miniature, on the built-in task.

    python -m bench.ablate                                   # η ∈ {0,1,2,4,8} × {decoupled, naive} × 2 seeds
    python -m bench.ablate --etas 0,8 --seeds 1 --steps 40 trainer.lr=6e-4   # key=value: launch.local overrides
    python -m bench.ablate --lock /tmp/areal-heavy.lock     # each run holds that flock (shared machine)

Every run is one `python -m launch.local` (as `make run` starts it), one after the other, with the
same steps, data and prompt order (data.seed is not varied); a run differs only in
algo.max_staleness (η), algo.decoupled (decoupled PPO recomputes the proximal policy; naive PPO
uses the behaviour log-probs, the paper's baseline) and trainer.seed. From each run it reads
summary.json (greedy_accuracy_end, accuracy_end = sampled pass@1) and metrics.jsonl (trained
tokens/s, held-out accuracy per policy version). The regime is the paper's and AReaL's recipes'
(boba_grpo.yaml): 4 minibatches per step (`algo.ppo_minibatches=4`: with one, π/π_prox is 1 on
the only optimiser step and decoupled PPO's clip never acts) and the behaviour weight capped at 5
(`algo.behav_weight_cap=5`, AReaL's `behave_imp_weight_cap`: drop tokens with exp(p - b) > 5);
naive PPO has p = b, so w = 1 and the cap never acts there. Writes <out>/ablation.json (every run and the
aggregated table), ablation.md (the table) and ablation.png (held-out accuracy against version per
η, one panel per objective). A failing run is recorded with its error; the others still run and
the exit code is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.ablation_table import OBJECTIVES, aggregate, curve_from_rows, markdown, mean_curves, tokens_per_s
from bench.harness import held_flock

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 3600
LOCK_YIELD_S = 5.0  # after each run, time for another job waiting on the lock to take it
# set per run by the ablation itself: an override of one of these is refused
VARIED = (
    "run.name",
    "run.root",
    "algo.max_staleness",
    "algo.decoupled",
    "trainer.seed",
    "trainer.total_steps",
)
# the ablation's defaults, each replaced by an override of the same key: an evaluation every 20
# steps gives the accuracy curves points between start and end (make run evaluates every 50)
DEFAULTS = {
    "run.eval_every_steps": "20",
    "run.tensorboard": "false",
    "checkpoint.resume": "false",
    "algo.ppo_minibatches": "4",  # AReaL's ppo_n_minibatches in its async recipes
    "algo.behav_weight_cap": "5",  # AReaL's behave_imp_weight_cap (drop mode, the default)
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ablate", description=__doc__.split("\n")[0])
    p.add_argument("--etas", type=_ints, default=[0, 1, 2, 4, 8], help="algo.max_staleness values")
    p.add_argument("--objectives", default="decoupled,naive", help="decoupled, naive or both")
    p.add_argument("--seeds", type=_ints, default=[1, 2], help="trainer.seed values")
    p.add_argument("--steps", type=int, default=60, help="trainer.total_steps of every run")
    p.add_argument("--out", type=Path, default=REPO / "bench", help="where ablation.{json,md,png} go")
    p.add_argument("--run-root", type=Path, default=REPO / "runs" / "ablate", help="run directories")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="take runs that already finished in --run-root (summary.json, same steps) instead of rerunning them",
    )
    p.add_argument(
        "--lock",
        type=Path,
        default=None,
        help="hold an exclusive flock on this file during each run (other heavy jobs interleave between runs)",
    )
    p.add_argument("overrides", nargs="*", help="launch.local overrides shared by every run (key=value)")
    args = p.parse_args(argv)
    args.objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    unknown = set(args.objectives) - set(OBJECTIVES)
    if unknown or not args.objectives:
        p.error(f"--objectives: choose from {','.join(OBJECTIVES)} (got {sorted(unknown) or 'none'})")
    if args.steps < 1 or not args.etas or not args.seeds or min(args.etas) < 0:
        p.error("--steps >= 1, --etas (each >= 0) and --seeds must be non-empty")
    for o in args.overrides:
        if "=" not in o:
            p.error(f"override {o!r} is not key=value")
        if o.split("=", 1)[0].lstrip("+") in VARIED:
            p.error(
                f"{o!r}: the ablation sets {', '.join(VARIED)} itself (--etas, --objectives, --seeds, --steps)"
            )
    given = {o.split("=", 1)[0].lstrip("+") for o in args.overrides}
    args.overrides = [f"{k}={v}" for k, v in DEFAULTS.items() if k not in given] + args.overrides
    return args


def _held(lock: Path | None):
    """An exclusive flock on `lock` for one run, then LOCK_YIELD_S for the other waiters."""
    return held_flock(lock, LOCK_YIELD_S)


def run_one(args: argparse.Namespace, eta: int, objective: str, seed: int) -> dict:
    """One launch.local run; its record for ablation_table (or one with "error")."""
    name = f"eta{eta}-{objective}-s{seed}"
    record: dict = {"eta": eta, "objective": objective, "seed": seed, "run_dir": str(args.run_root / name)}
    cmd = [
        sys.executable, "-m", "launch.local", f"run.name={name}", f"run.root={args.run_root}",
        f"algo.max_staleness={eta}", f"algo.decoupled={str(objective == 'decoupled').lower()}",
        f"trainer.seed={seed}", f"trainer.total_steps={args.steps}", *args.overrides,
    ]  # fmt: skip
    run_dir = args.run_root / name
    summary_path = run_dir / "summary.json"
    finished = summary_path.exists() and json.loads(summary_path.read_text()).get("steps") == args.steps
    if args.reuse and finished:
        record["wall_s"] = json.loads(summary_path.read_text()).get("wall_s")
        record["reused"] = True
    else:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        with _held(args.lock):
            t0 = time.monotonic()
            result = subprocess.run(
                cmd, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env
            )
            record["wall_s"] = round(time.monotonic() - t0, 1)
        if result.returncode != 0 or not summary_path.exists():
            record["error"] = f"launch.local exit {result.returncode}: {result.stderr[-1500:]}"
            return record
    summary = json.loads(summary_path.read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    record.update(
        greedy_start=summary.get("greedy_accuracy_start"),
        sampled_start=summary.get("accuracy_start"),
        greedy_end=summary.get("greedy_accuracy_end"),
        sampled_end=summary.get("accuracy_end"),
        steps=summary.get("steps"),
        max_staleness_seen=summary.get("max_staleness_seen"),
        tokens_per_s=tokens_per_s(rows),
        curve=curve_from_rows(rows),
    )
    return record


def plot(runs: list[dict], objectives: list[str], path: Path) -> Path | None:
    """Held-out accuracy against policy version: one panel per objective, one colour per η,
    sampled (pass@1) solid, greedy dashed; each curve the mean over seeds."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot written", file=sys.stderr)
        return None
    etas = sorted({r["eta"] for r in runs})
    colours = plt.get_cmap("viridis")
    fig, axes = plt.subplots(
        1, len(objectives), figsize=(6.5 * len(objectives), 4.2), sharey=True, squeeze=False
    )
    for ax, objective in zip(axes[0], objectives):
        for eta, curves in mean_curves(runs, objective).items():
            colour = colours(etas.index(eta) / max(len(etas) - 1, 1))
            if curves["sampled"]:
                ax.plot(*zip(*curves["sampled"]), "o-", color=colour, label=f"η={eta} sampled")
            if curves["greedy"]:
                ax.plot(*zip(*curves["greedy"]), "s--", color=colour, alpha=0.7, label=f"η={eta} greedy")
        ax.set_title(f"{objective} PPO")
        ax.set_xlabel("policy version (training steps)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right", ncol=2)
    axes[0][0].set_ylabel("held-out accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(args: argparse.Namespace, runs: list[dict]) -> str:
    table = aggregate(runs)
    text = markdown(table)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {"etas": args.etas, "objectives": args.objectives, "seeds": args.seeds,
                "steps": args.steps, "overrides": args.overrides}  # fmt: skip
    (args.out / "ablation.json").write_text(
        json.dumps({"settings": settings, "table": table, "runs": runs}, indent=2)
    )
    (args.out / "ablation.md").write_text(text + "\n")
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # seed-major: an ablation cut short still has a whole table for its first seeds
    plan = [(e, o, s) for s in args.seeds for e in args.etas for o in args.objectives]
    runs: list[dict] = []
    t_start = time.monotonic()
    for i, (eta, objective, seed) in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] η={eta} {objective} seed={seed} ...", flush=True)
        record = run_one(args, eta, objective, seed)
        runs.append(record)
        if "error" in record:
            print(f"  FAILED after {record['wall_s']} s: {record['error'][-600:]}", flush=True)
        else:
            print(
                f"  greedy {record['greedy_start']:.3f} -> {record['greedy_end']:.3f}, sampled "
                f"{record['sampled_start']:.3f} -> {record['sampled_end']:.3f}, "
                f"{record['tokens_per_s'] or 0:.0f} trained tokens/s, {record['wall_s']} s "
                f"(elapsed {time.monotonic() - t_start:.0f} s)",
                flush=True,
            )
        write(args, runs)  # after every run: an interrupted ablation keeps what it measured
    text = write(args, runs)
    png = plot(runs, args.objectives, args.out / "ablation.png")
    print(text)
    print(f"wrote {args.out / 'ablation.json'}, {args.out / 'ablation.md'}" + (f", {png}" if png else ""))
    return 1 if any("error" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
