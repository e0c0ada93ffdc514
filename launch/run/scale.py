"""Grow or shrink the rollout pool of a running local job: `make scale RUN=runs/<name> SERVERS=+1`.

    python -m launch.scale runs/tiny-arith +1     # one more SGLang/vLLM server
    python -m launch.scale runs/tiny-arith -1     # drain one (no request lost), then stop it
    python -m launch.scale runs/tiny-arith 3      # exactly three

Writes RUN_DIR/scale.json; the job's launch.local acts on it within a second (launch/run/elastic.py)
and logs what it did in logs/controller.log and its own output. A new server takes work once the
next weight update gave it the current weights.

SLURM jobs (cluster.kind=slurm): the change counts rollout NODES and acts through satellite jobs
(launch/slurm/satellites.py): `+N` submits N one-node jobs of servers that join the run, `-N` drains
the servers of the N added last and then ends those jobs (it waits for the drain, at most
--drain-timeout-s); `N` asks for N rollout nodes in all.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import yaml

from areal_jobs.transport import discovery
from launch.run.elastic import read_target, write_target
from launch.slurm import satellites as scale_slurm
from launch.slurm.cli import SlurmError


def current_servers(run_dir: Path) -> int:
    """What the job runs now: the last request, else the servers registered and not leaving."""
    target = read_target(run_dir)
    if target is not None:
        return target
    leaving = discovery.leaving(run_dir)
    return sum(1 for rec in discovery.read_servers(run_dir) if rec.index not in leaving)


def parse_change(text: str, current: int) -> int:
    """'+N' / '-N': relative to `current`; 'N': absolute. Returns the target."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r}: write +N, -N or N (e.g. +1)") from None
    return current + value if text[:1] in "+-" else value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.scale", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path, help="the running job's directory (runs/<run.name>)")
    p.add_argument("change", help="+N, -N or N rollout servers (SLURM: rollout nodes)")
    p.add_argument(
        "--drain-timeout-s", type=float, default=900.0, help="SLURM -N: longest wait for the drain"
    )
    args = p.parse_args(argv)
    run_dir = args.run_dir
    config = run_dir / "config.yaml"
    if not config.exists():
        p.error(f"{run_dir} is not a run directory (no config.yaml there)")
    if (yaml.safe_load(config.read_text()).get("cluster") or {}).get("kind", "local") == "slurm":
        return scale_slurm_job(p, run_dir, args.change, args.drain_timeout_s)
    if not (run_dir / "pids.json").exists():
        p.error(f"{run_dir} is not a running launch.local job (no pids.json there)")
    current = current_servers(run_dir)
    try:
        target = parse_change(args.change, current)
        write_target(run_dir, target)
    except ValueError as exc:
        p.error(str(exc))
    print(json.dumps({"run_dir": str(run_dir), "num_servers_before": current, "num_servers": target}))
    return 0


def scale_slurm_job(p: argparse.ArgumentParser, run_dir: Path, change: str, drain_timeout_s: float) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        current = scale_slurm.rollout_nodes(run_dir)
        delta = parse_change(change, current) - current
        if delta > 0:
            changed = scale_slurm.grow(run_dir, delta)
        elif delta < 0:
            changed = scale_slurm.shrink(run_dir, -delta, drain_timeout_s)
        else:
            changed = []
    except (ValueError, SlurmError, TimeoutError) as exc:
        p.error(str(exc))
    print(
        json.dumps(
            {
                "run_dir": str(run_dir),
                "rollout_nodes_before": current,
                "rollout_nodes": current + delta,
                "added" if delta > 0 else "released": [
                    {"job_id": s.job_id, "servers": s.indices} for s in changed
                ],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
