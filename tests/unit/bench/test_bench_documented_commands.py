"""Every `python -m bench...` command that README.md, docs/, the bench READMEs and the Makefile show
still starts: `--help` runs for each module that parses arguments (issue 45: the move into rooms
kept the commands users type). A module without argparse would run its benchmark on `--help`, so
it is only required to resolve to a file of bench/."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SHOWN_IN = ["README.md", "Makefile", *sorted(str(p.relative_to(REPO)) for p in REPO.glob("docs/*.md"))]
SHOWN_IN += sorted(str(p.relative_to(REPO)) for p in REPO.glob("bench/**/README.md"))
COMMAND_RE = re.compile(r"-m (bench(?:\.[a-z_]+)*)\b")


def documented_modules() -> list[str]:
    found = set()
    for name in SHOWN_IN:
        found.update(COMMAND_RE.findall((REPO / name).read_text()))
    return sorted(found)


def test_the_docs_show_bench_commands():
    assert {"bench", "bench.staleness.ablate", "bench.trainer.gpu_trainer"} <= set(documented_modules())


@pytest.mark.parametrize("module", documented_modules())
def test_each_documented_bench_command_answers_help(module):
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"`python -m {module}` names no module: fix the doc or the move"
    origin = Path(spec.origin)
    if origin.name == "__init__.py":
        origin = origin.with_name("__main__.py")
    assert origin.is_file() and REPO / "bench" in origin.parents, f"{module} resolves to {origin}"
    if "argparse" not in origin.read_text():
        return  # `--help` would run the benchmark itself
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0 and "usage:" in out.stdout, f"python -m {module} --help:\n{out.stderr[-2000:]}"
