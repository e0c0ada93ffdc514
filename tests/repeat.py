"""Run the flakiest groups of the suite again and again; report every test that ever failed.

    make test-repeat N=5 GROUPS="e2e slurm engines"
    python tests/repeat.py --runs 5 e2e slurm engines [-- extra pytest arguments]

Each repetition is a fresh pytest process over the groups' paths (two xdist workers and the
suite's groups, as `make test`), so state that leaks between sessions shows too. Every run's
JUnit XML and log go to --out (default runs/test-repeat/<time>/); the report lists, for every
test that failed at least once, how often and the first line of each distinct failure, and
summary.json holds the same. Exit 1 if any test failed in any repetition, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GROUPS = {
    "e2e": ["tests/integration/e2e"],
    "slurm": ["tests/integration/slurm"],
    "engines": ["tests/integration/sglang", "tests/integration/vllm"],
    "trainers": ["tests/integration/megatron", "tests/integration/fsdp", "tests/integration/contract"],
    "reward": ["tests/integration/reward"],
    "bench": ["tests/integration/bench"],
    "unit": ["tests/unit"],
}


def parse_junit(path: Path) -> dict[str, str | None]:
    """test id -> None (passed or skipped) or the first line of its failure / error."""
    outcomes: dict[str, str | None] = {}
    if not path.exists():
        return outcomes
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is None:
            outcomes[test] = None
        else:
            message = (problem.get("message") or problem.text or "").strip().splitlines()
            outcomes[test] = (message[0] if message else problem.tag)[:200]
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "groups", nargs="*", default=["e2e", "slurm", "engines"], help=f"of {sorted(GROUPS)}, or paths"
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    paths = []
    for group in args.groups:
        if group in GROUPS:
            paths += GROUPS[group]
        elif (REPO / group).exists():
            paths.append(group)
        else:
            parser.error(f"unknown group {group!r}: one of {sorted(GROUPS)} or a path under {REPO}")
    out = args.out or REPO / "runs" / "test-repeat" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    failures: dict[str, list[tuple[int, str]]] = defaultdict(list)
    seen: dict[str, int] = defaultdict(int)
    walls = []
    for run in range(1, args.runs + 1):
        xml = out / f"run-{run}.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "not gpu",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml}",
            "-q",
        ]
        if args.workers > 0:
            cmd += ["-n", str(args.workers), "--dist", "loadgroup", "--no-loadscope-reorder"]
        cmd += [*extra, *paths]
        t0 = time.monotonic()
        with (out / f"run-{run}.log").open("w") as log:
            code = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        walls.append(time.monotonic() - t0)
        outcomes = parse_junit(xml)
        for test, problem in outcomes.items():
            seen[test] += 1
            if problem is not None:
                failures[test].append((run, problem))
        failed_now = sum(p is not None for p in outcomes.values())
        print(
            f"run {run}/{args.runs}: {len(outcomes)} tests, {failed_now} failed, pytest exit {code}, "
            f"{walls[-1]:.0f}s (log: {out / f'run-{run}.log'})",
            flush=True,
        )
        if code not in (0, 1) and not failed_now:  # collection errors, interrupted, nothing collected
            failures[f"<pytest exit {code} in run {run}>"].append((run, "see the run's log"))
    summary = {
        "runs": args.runs,
        "groups": args.groups,
        "paths": paths,
        "wall_s": [round(w, 1) for w in walls],
        "tests": len(seen),
        "failed": {test: [{"run": r, "failure": f} for r, f in runs] for test, runs in failures.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{len(seen)} tests x {args.runs} runs over {' '.join(paths)}; {sum(walls):.0f}s in all")
    if not failures:
        print("no test failed in any run")
        return 0
    print(f"{len(failures)} tests failed at least once:")
    for test, runs in sorted(failures.items()):
        print(f"  {test}: failed in {len(runs)} of {seen.get(test, args.runs)} runs")
        for problem in sorted({p for _, p in runs}):
            print(f"      {problem}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
