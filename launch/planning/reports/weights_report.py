"""Simulator report: the weight update's phases, full copy vs delta, and what they do to the
async/sync gain of a 7B and a 32B run on 400 Gb/s links.

    python -m launch.simulate weights                    # trainer_heavy_7b and trainer_heavy_32b
    python -m launch.simulate weights --link-gbit 100,400 --changed 0.01,0.03

Writes <out>/weights.md and weights.json (default out runs/sim/weights) and prints the tables. The
phase model and its assumptions: launch/planning/sim/weight_update.py; the schedules are the
simulator's (run_async with eta from the profile, run_sync with eta = 0), each step paying the
update of its version (a full copy every `full_every`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
from pathlib import Path

from launch.planning.sim.engine import run_async, run_sync
from launch.planning.sim.profile import SimProfile, load_profile

# profile -> parameters (billions): Qwen2.5-7B (7.6B), Qwen2.5-32B (32.8B)
MODELS = {"trainer_heavy_7b": 7.6, "trainer_heavy_32b": 32.8}
MODES = (("full", "host"), ("delta", "host"), ("delta", "device"))


def with_weights(p: SimProfile, params_b: float, mode: str, where: str, **kw) -> SimProfile:
    q = copy.deepcopy(p)
    q.weights = dataclasses.replace(q.weights, params_b=params_b, mode=mode, copy=where, **kw)
    q.weights.check()
    return q


def rows_for(profile: str, link_gbit: float, changed: float, host_threads: int) -> list[dict]:
    base = load_profile(profile)
    rows = []
    for mode, where in MODES:
        q = with_weights(
            base, MODELS[profile], mode, where,
            link_gbit_per_s=link_gbit, changed_fraction=changed, host_threads=host_threads,
        )  # fmt: skip
        w = q.weights
        phases = w.phases(delta=mode == "delta")
        a, s = run_async(q), run_sync(q)
        rows.append(
            {
                "profile": profile,
                "params_b": w.params_b,
                "link_gbit": link_gbit,
                "changed": changed,
                "mode": mode if mode == "full" else f"delta ({where} copy{_threads(where, host_threads)})",
                "bytes_gb": (w.delta_bytes if mode == "delta" else w.full_bytes) / 1e9,
                "phases": phases,
                "update_s": sum(phases.values()),
                "mean_update_s": w.mean_update_s(),
                "async_tok_s": a.tokens_per_s,
                "sync_tok_s": s.tokens_per_s,
                "async_step_s": a.step_s,
                "gain": a.tokens_per_s / s.tokens_per_s,
            }
        )
    return rows


def _threads(where: str, threads: int) -> str:
    return f", {threads} threads" if where == "host" else ""


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | link Gb/s | changed | update | bytes GB | fixed + gather + stage + wire + load s | update s "
        "| mean over the anchor cycle s | async step s | async tok/s | sync tok/s | async/sync |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ph = r["phases"]
        parts = " + ".join(f"{ph[k]:.2f}" for k in ("fixed", "gather", "stage", "wire", "load"))
        lines.append(
            f"| {r['params_b']:g}B | {r['link_gbit']:g} | {r['changed']:.0%} | {r['mode']} | {r['bytes_gb']:.2f} "
            f"| {parts} | {r['update_s']:.2f} | {r['mean_update_s']:.2f} | {r['async_step_s']:.1f} "
            f"| {r['async_tok_s']:,.0f} | {r['sync_tok_s']:,.0f} | {r['gain']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launch.simulate weights", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--profiles", default=",".join(MODELS), help="profiles with a known parameter count")
    parser.add_argument("--link-gbit", default="400", help="sender NIC line rates, Gb/s, comma-separated")
    parser.add_argument("--changed", default="0.01", help="shares of bf16 values changed per step")
    parser.add_argument(
        "--host-threads", default="16,1", help="cores the host-copy scans use, comma-separated"
    )
    parser.add_argument("--out", default="runs/sim/weights")
    args = parser.parse_args(argv)
    rows = []
    for profile in args.profiles.split(","):
        if profile not in MODELS:
            raise SystemExit(f"no parameter count for profile {profile!r}: one of {sorted(MODELS)}")
        for link in (float(x) for x in args.link_gbit.split(",")):
            for changed in (float(x) for x in args.changed.split(",")):
                for threads in (int(x) for x in args.host_threads.split(",")):
                    rows += [
                        r for r in rows_for(profile, link, changed, threads)
                        if threads == int(args.host_threads.split(",")[0]) or "host" in r["mode"]
                    ]  # fmt: skip
    table = markdown(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "weights.md").write_text(table + "\n")
    (out / "weights.json").write_text(json.dumps(rows, indent=1))
    print(table)
    print(f"\nwrote {out / 'weights.md'} and weights.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
