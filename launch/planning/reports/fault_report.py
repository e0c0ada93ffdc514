"""Simulator reports: self-healing vs kill-and-requeue under failures; re-planning as answers grow.

The first compares the two recovery policies at realistic failure rates, the second a split planned
at the start against one re-planned from measurements on a run whose answers grow.

    python -m launch.simulate faults                      # paper_1p5b: 64 x 8 H800, 384 servers
    python -m launch.simulate faults --mtbf-h 50700,5070 --requeue-wait-s 900,7200
    python -m launch.simulate replan                      # answers doubling over 1000 steps
    python -m launch.simulate replan --factors 1,1.5,2,3 --resplit-cost-s 600

Each writes <out>/{faults,replan}.md, .json and .png (default out runs/sim/<profile>) and prints the
table. Deterministic: the simulator is seeded by the profile, the fault model is closed-form.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from launch.planning.replanning.replan import GrowthReport, growth_comparison
from launch.planning.sim.engine import run_async
from launch.planning.sim.faults import LLAMA3_GPU_MTBF_H, FaultModel, FaultOutcome, compare
from launch.planning.sim.profile import SimProfile, load_profile

DEFAULT_MTBF_H = (LLAMA3_GPU_MTBF_H, LLAMA3_GPU_MTBF_H / 3, LLAMA3_GPU_MTBF_H / 10, LLAMA3_GPU_MTBF_H / 30)
DEFAULT_WAITS_S = (900.0, 7200.0)


def faults_markdown(rows: list[tuple[FaultModel, FaultOutcome]]) -> str:
    lines = [
        "| GPU MTBF h | requeue wait s | job stops/day: requeue / healing | server restarts/day | node losses/day "
        "| servers down (mean) | useful: requeue / healing | tok/s: requeue / healing | steps/h: requeue / healing "
        "| healing gain |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m, o in rows:
        lines.append(
            f"| {m.gpu_mtbf_h:,.0f} | {m.requeue_wait_s:,.0f} | {o.job_interruptions_per_day_requeue:.2f} / "
            f"{o.job_interruptions_per_day_healing:.2f} | {o.server_restarts_per_day:.2f} | {o.node_losses_per_day:.2f} "
            f"| {o.servers_down_mean:.2f} | {o.useful_requeue:.3f} / {o.useful_healing:.3f} "
            f"| {o.tokens_per_s_requeue:,.0f} / {o.tokens_per_s_healing:,.0f} "
            f"| {o.steps_per_h_requeue:.1f} / {o.steps_per_h_healing:.1f} | {o.gain:.3f} |"
        )
    return "\n".join(lines)


def replan_markdown(r: GrowthReport) -> str:
    lines = [
        "| window | answer length x | static split | static tok/s | static step s | re-planned split "
        "| re-planned tok/s | re-planned step s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, w in enumerate(r.windows):
        lines.append(
            f"| {i} | {w.factor:g} | {w.static_fraction:.4f} | {w.static.tokens_per_s:,.0f} | {w.static.step_s:.1f} "
            f"| {w.replanned_fraction:.4f} | {w.replanned.tokens_per_s:,.0f} | {w.replanned.step_s:.1f} |"
        )
    lines.append(
        f"\n{len(r.windows)} windows of {r.steps_per_window} steps: static {r.static_s / 3600:.2f} h, re-planned "
        f"{r.replanned_s / 3600:.2f} h ({r.changes} split changes at {r.resplit_cost_s:.0f} s each): "
        f"**re-planning gain {r.gain:.3f}x** (same steps, wall time static / re-planned)."
    )
    return "\n".join(lines)


def _plot_faults(rows: list[tuple[FaultModel, FaultOutcome]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for color, wait in zip(
        ("C0", "C1", "C2", "C3"), sorted({m.requeue_wait_s for m, _ in rows}), strict=False
    ):
        sel = [(m, o) for m, o in rows if m.requeue_wait_s == wait]
        x = [m.gpu_mtbf_h for m, _ in sel]
        ax.plot(
            x,
            [o.useful_requeue for _, o in sel],
            "s--",
            color=color,
            label=f"kill-and-requeue, wait {wait / 60:.0f} min",
        )
        ax.plot(
            x,
            [o.useful_healing for _, o in sel],
            "o-",
            color=color,
            label=f"self-healing, wait {wait / 60:.0f} min",
        )
    mtbfs = sorted({m.gpu_mtbf_h for m, _ in rows})
    ax.set(
        xscale="log", xlabel="per-GPU MTBF (hours)", ylabel="share of failure-free throughput", title=title
    )
    ax.set_xticks(mtbfs, [f"{x:,.0f}" for x in mtbfs])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_replan(r: GrowthReport, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = [w.factor for w in r.windows]
    ax.plot(x, [w.static.tokens_per_s / 1e6 for w in r.windows], "s--", label="split planned at the start")
    ax.plot(x, [w.replanned.tokens_per_s / 1e6 for w in r.windows], "o-", label="re-planned every window")
    ax.set(xlabel="answer length (x the start)", ylabel="trained tokens/s (millions)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def faults(
    profile: SimProfile, mtbf_h: list[float], waits_s: list[float], every_steps: int, base: FaultModel
):
    r = run_async(profile)
    rollout_gpus, trainer_gpus = profile.split()
    rows = []
    for mtbf in mtbf_h:
        for wait in waits_s:
            m = dataclasses.replace(
                base, gpu_mtbf_h=mtbf, requeue_wait_s=wait, checkpoint_interval_s=every_steps * r.step_s
            )
            o = compare(
                m,
                rollout_gpus=rollout_gpus,
                trainer_gpus=trainer_gpus,
                gpus_per_server=profile.cluster.rollout_tp,
                gpus_per_node=profile.cluster.gpus_per_node,
                tokens_per_s=r.tokens_per_s,
                step_s=r.step_s,
            )
            rows.append((m, o))
    intro = (
        f"{profile.cluster.nodes} x {profile.cluster.gpus_per_node} GPUs, {rollout_gpus} rollout GPUs "
        f"({rollout_gpus // profile.cluster.rollout_tp} servers) + {trainer_gpus} trainer GPUs; failure-free "
        f"{r.tokens_per_s:,.0f} trained tok/s, {r.step_s:.1f} s/step; checkpoint every {every_steps} steps "
        f"({every_steps * r.step_s:,.0f} s); restartable share {base.restartable_share:.2f}, server restart "
        f"{base.server_restart_s:.0f} s, node replacement {base.node_replace_s:.0f} s, start-up {base.startup_s:.0f} s."
    )
    return rows, intro


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.simulate", description=__doc__.splitlines()[0])
    parser.add_argument("report", choices=["faults", "replan"])
    parser.add_argument("--profile", default="paper_1p5b", help="conf/sim/<name>.yaml or a YAML path")
    parser.add_argument("--out", default="", help="output directory (default runs/sim/<profile>)")
    parser.add_argument(
        "--mtbf-h", default=",".join(f"{x:.0f}" for x in DEFAULT_MTBF_H), help="per-GPU MTBFs"
    )
    parser.add_argument("--requeue-wait-s", default=",".join(f"{x:.0f}" for x in DEFAULT_WAITS_S))
    parser.add_argument("--checkpoint-every-steps", type=int, default=50, help="checkpoint.every_steps")
    parser.add_argument("--restartable-share", type=float, default=FaultModel.restartable_share)
    parser.add_argument("--server-restart-s", type=float, default=FaultModel.server_restart_s)
    parser.add_argument("--node-replace-s", type=float, default=FaultModel.node_replace_s)
    parser.add_argument("--startup-s", type=float, default=FaultModel.startup_s)
    parser.add_argument("--factors", default="1,1.25,1.5,1.75,2", help="replan: answer length per window")
    parser.add_argument("--total-steps", type=int, default=1000, help="replan: steps of the run")
    parser.add_argument("--resplit-cost-s", type=float, default=600.0, help="replan: cost of a split change")
    parser.add_argument(
        "--min-gain", type=float, default=1.0, help="replan: change the split only for this expected gain"
    )
    parser.add_argument(
        "--attention-share",
        type=float,
        default=0.5,
        help="replan: share of training cost that grows with length",
    )
    parser.add_argument("overrides", nargs="*", help="profile overrides, e.g. cluster.nodes=32")
    args = parser.parse_intermixed_args(argv)  # overrides may follow the options
    try:
        profile = load_profile(args.profile, args.overrides)
        out = Path(args.out or f"runs/sim/{profile.name}")
        if args.report == "faults":
            base = FaultModel(
                restartable_share=args.restartable_share,
                server_restart_s=args.server_restart_s,
                node_replace_s=args.node_replace_s,
                startup_s=args.startup_s,
            )
            mtbf = [float(x) for x in args.mtbf_h.split(",")]
            waits = [float(x) for x in args.requeue_wait_s.split(",")]
            rows, intro = faults(profile, mtbf, waits, args.checkpoint_every_steps, base)
            table, payload = (
                faults_markdown(rows),
                [{"faults": dataclasses.asdict(m), "outcome": dataclasses.asdict(o)} for m, o in rows],
            )
            text = f"## Self-healing vs kill-and-requeue: {profile.name}\n\n{intro}\n\n{table}"
        else:
            factors = tuple(float(x) for x in args.factors.split(","))
            report = growth_comparison(
                profile,
                factors,
                args.total_steps // len(factors),
                args.resplit_cost_s,
                args.min_gain,
                args.attention_share,
            )
            text = (
                f"## Online re-planning, answers growing {factors[0]:g}x -> {factors[-1]:g}x: {profile.name}\n\n"
                f"Training cost per token: {1 - args.attention_share:g} fixed + {args.attention_share:g} x length; "
                f"split changes when the expected gain reaches {args.min_gain:g}.\n\n"
            )
            text += replan_markdown(report)
            payload = [
                {"factor": w.factor, "static_fraction": w.static_fraction, "replanned_fraction": w.replanned_fraction,
                 "static": dataclasses.asdict(w.static), "replanned": dataclasses.asdict(w.replanned)}
                for w in report.windows
            ]  # fmt: skip
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.report}.md").write_text(text + "\n")
    (out / f"{args.report}.json").write_text(json.dumps(payload, indent=2))
    if args.report == "faults":
        _plot_faults(rows, f"{profile.name}: effective throughput under failures", out / "faults.png")
    else:
        _plot_replan(report, f"{profile.name}: static split vs re-planned", out / "replan.png")
    print(text)
    print(f"\nwrote {out / args.report}.md, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
