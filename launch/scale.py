"""Grow or shrink the rollout pool of a running local job: `make scale RUN=runs/<name> SERVERS=+1`.

    python -m launch.scale runs/tiny-arith +1     # one more SGLang/vLLM server
    python -m launch.scale runs/tiny-arith -1     # drain one (no request lost), then stop it
    python -m launch.scale runs/tiny-arith 3      # exactly three

Writes RUN_DIR/scale.json; the job's launch.local acts on it within a second (launch/elastic.py)
and logs what it did in logs/controller.log and its own output. A new server takes work once the
next weight update gave it the current weights. SLURM jobs: not yet (see docs/faults.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from areal_jobs.transport import discovery
from launch.elastic import read_target, write_target


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
    p.add_argument("change", help="+N, -N or N rollout servers")
    args = p.parse_args(argv)
    run_dir = args.run_dir
    config = run_dir / "config.yaml"
    if not (run_dir / "pids.json").exists() or not config.exists():
        p.error(f"{run_dir} is not a running launch.local job (no pids.json / config.yaml there)")
    if (yaml.safe_load(config.read_text()).get("cluster") or {}).get("kind", "local") != "local":
        p.error("scaling a SLURM job's rollout pool is not supported yet: it runs cluster=local jobs")
    current = current_servers(run_dir)
    try:
        target = parse_change(args.change, current)
        write_target(run_dir, target)
    except ValueError as exc:
        p.error(str(exc))
    print(json.dumps({"run_dir": str(run_dir), "num_servers_before": current, "num_servers": target}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
