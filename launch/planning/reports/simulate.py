"""Simulate a cluster: effective training throughput against GPUs (async / sync / colocated sync)
and against the staleness bound eta, from a profile in conf/sim/.

    python -m launch.simulate                                   # the paper setting (paper_1p5b)
    python -m launch.simulate --profile trainer_heavy_7b algo.max_staleness=8
    python -m launch.simulate --gpus 64,128,256,512 --etas 0,1,2,4,8 --out runs/sim/paper
    python -m launch.simulate faults | replan ...   # failures and online re-planning (launch/planning/reports/fault_report.py)
    python -m launch.simulate weights               # update phases, full vs delta, 7B and 32B (weights_report.py)

Writes <out>/simulate.png, simulate.md (the tables printed here) and simulate.json.
The schedule drives the project's StalenessManager, split_fresh and balanced_microbatches
(launch/planning/sim/engine.py); the inputs are stated in the profile's YAML.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from launch.planning.sim.engine import SimResult
from launch.planning.sim.profile import SimProfile, load_profile
from launch.planning.sim.sweep import DEFAULT_ETAS, DEFAULT_GPUS, ScalingRow, scaling, staleness_sweep


def scaling_markdown(rows: list[ScalingRow]) -> str:
    lines = [
        "| GPUs | rollout + trainer GPUs | async tok/s | sync tok/s | colocated tok/s | async/sync "
        "| async/colocated | scaling eff. | expired groups | staleness mean / max |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        a = r.async_
        lines.append(
            f"| {r.gpus} | {a.rollout_gpus} + {a.trainer_gpus} | {a.tokens_per_s:,.0f} | {r.sync.tokens_per_s:,.0f} "
            f"| {r.colocated.tokens_per_s:,.0f} | {r.async_over_sync:.2f} | {r.async_over_colocated:.2f} "
            f"| {r.efficiency:.2f} | {a.expired_groups} | {a.staleness_mean:.2f} / {a.staleness_max} |"
        )
    return "\n".join(lines)


def eta_markdown(results: list[SimResult]) -> str:
    lines = [
        "| eta | tok/s | step s | waiting for batch s | train + sync s | expired groups | staleness mean / max "
        "| rollout busy | modelled drift |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        eta = str(r.max_staleness)
        if r.bounds:  # algo.staleness_auto: the bound moved; its last value and its range
            eta = f"auto <= {r.max_staleness} (last {r.bounds[-1]}, {min(r.bounds)}-{max(r.bounds)})"
        lines.append(
            f"| {eta} | {r.tokens_per_s:,.0f} | {r.step_s:.1f} | {max(r.gen_s, 0.0):.1f} | {r.train_s:.1f} "
            f"| {r.expired_groups} | {r.staleness_mean:.2f} / {r.staleness_max} | {r.rollout_busy:.2f} "
            f"| {r.drift_mean:.3f} |"
        )
    return "\n".join(lines)


def headline(rows: list[ScalingRow]) -> str:
    last = rows[-1]
    return (
        f"at {last.gpus} GPUs: async/sync {last.async_over_sync:.2f}, async/colocated {last.async_over_colocated:.2f}; "
        f"scaling efficiency {rows[0].gpus}->{last.gpus} GPUs: {last.efficiency:.2f}"
    )


def plot(rows: list[ScalingRow], etas: list[SimResult], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    gpus = [r.gpus for r in rows]
    for label, values, style in (
        ("async", [r.async_.tokens_per_s for r in rows], "o-"),
        ("sync (same split, eta=0)", [r.sync.tokens_per_s for r in rows], "s--"),
        ("colocated sync", [r.colocated.tokens_per_s for r in rows], "^:"),
    ):
        left.plot(gpus, [v / 1e6 for v in values], style, label=label)
    ideal = rows[0].async_.tokens_per_s / rows[0].gpus
    left.plot(
        gpus, [ideal * g / 1e6 for g in gpus], color="grey", lw=0.8, label="linear from the first point"
    )
    left.set(xscale="log", xlabel="GPUs", ylabel="trained tokens/s (millions)", title="throughput vs GPUs")
    left.set_xticks(gpus, [str(g) for g in gpus])
    left.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # no "6x10^1" labels between
    left.legend(fontsize=8)
    fixed = [r for r in etas if not r.bounds]
    right.plot([r.max_staleness for r in fixed], [r.tokens_per_s / 1e6 for r in fixed], "o-")
    for r in etas:
        if r.bounds:  # algo.staleness_auto: at the mean realised staleness, with its own marker
            right.plot([r.staleness_mean], [r.tokens_per_s / 1e6], "r*", ms=12, label="auto")
            right.legend(fontsize=8)
    right.set(
        xlabel="max staleness eta",
        ylabel="trained tokens/s (millions)",
        title=f"throughput vs eta ({etas[0].gpus} GPUs)",
    )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def inputs_markdown(p: SimProfile) -> str:
    parts = {k: v for k, v in dataclasses.asdict(p).items() if k not in ("name", "description")}
    return "\n".join(f"- `{k}`: {json.dumps(v)}" for k, v in parts.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("faults", "replan"):
        from launch.planning.reports.fault_report import main as report_main

        return report_main(argv)
    if argv and argv[0] == "weights":
        from launch.planning.reports.weights_report import main as weights_main

        return weights_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m launch.simulate", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="paper_1p5b", help="conf/sim/<name>.yaml or a YAML path")
    parser.add_argument(
        "--gpus", default=",".join(map(str, DEFAULT_GPUS)), help="cluster sizes, comma-separated"
    )
    parser.add_argument("--etas", default=",".join(map(str, DEFAULT_ETAS)), help="staleness bounds to sweep")
    parser.add_argument("--out", default="", help="output directory (default runs/sim/<profile>)")
    parser.add_argument("overrides", nargs="*", help="profile overrides, e.g. algo.max_staleness=8")
    args = parser.parse_args(argv)
    try:
        profile = load_profile(args.profile, args.overrides)
        gpus = tuple(int(g) for g in args.gpus.split(","))
        etas = tuple(int(e) for e in args.etas.split(","))
        rows = scaling(profile, gpus)
        eta_rows = staleness_sweep(profile, etas)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/sim/{profile.name}")
    out.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(
        [
            f"## Simulated throughput: {profile.name}",
            profile.description.strip(),
            f"**{headline(rows)}**",
            scaling_markdown(rows),
            f"Against eta at {profile.cluster.gpus} GPUs (rollout fraction {profile.cluster.rollout_fraction}):",
            eta_markdown(eta_rows),
            "Inputs:\n" + inputs_markdown(profile),
        ]
    )
    (out / "simulate.md").write_text(text + "\n")
    payload = {
        "profile": dataclasses.asdict(profile),
        "scaling": [
            {"gpus": r.gpus, "efficiency": r.efficiency, "async": dataclasses.asdict(r.async_),
             "sync": dataclasses.asdict(r.sync), "colocated": dataclasses.asdict(r.colocated)}
            for r in rows
        ],
        "eta": [dataclasses.asdict(r) for r in eta_rows],
    }  # fmt: skip
    (out / "simulate.json").write_text(json.dumps(payload, indent=2))
    plot(rows, eta_rows, f"{profile.name}: {headline(rows)}", out / "simulate.png")
    print(text)
    print(f"\nwrote {out / 'simulate.png'}, {out / 'simulate.md'}, {out / 'simulate.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
