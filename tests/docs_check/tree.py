"""The repository as files: what exists, what is a run's output, modules and their options."""

from __future__ import annotations

import fnmatch
import functools
import re
from pathlib import Path

REPO = next(p for p in Path(__file__).resolve().parents if (p / "Makefile").is_file())
SKIP_DIRS = {".git"}  # and every gitignored folder (.venv, runs/, caches): not what a clone has


@functools.cache
def repo_files() -> frozenset[str]:
    out = set()
    stack = [REPO]
    while stack:
        d = stack.pop()
        for p in d.iterdir():
            rel = p.relative_to(REPO).as_posix()
            if is_output(rel):
                continue
            if p.is_dir():
                if p.name not in SKIP_DIRS:
                    stack.append(p)
                    out.add(rel + "/")
            else:
                out.add(rel)
    return frozenset(out)


@functools.cache
def roots() -> frozenset[str]:
    """Top-level names a repository path starts with (areal_jobs, bench, docs, .ci, Makefile...)."""
    return frozenset(f.split("/")[0] for f in repo_files())


@functools.cache
def ignored_patterns() -> tuple[str, ...]:
    lines = (REPO / ".gitignore").read_text().splitlines()
    return tuple(x.strip() for x in lines if x.strip() and not x.startswith("#"))


def is_output(path: str) -> bool:
    """A run's or a command's output (gitignored), not something the repository ships. As git reads
    .gitignore: a pattern without a slash matches a name at any depth (__pycache__, *.pyc), one with
    a slash the path from the top; the last matching pattern wins (`!bench/staleness/results/ablation.png`)."""
    parts = path.strip("/").split("/")
    ignored = False
    for line in ignored_patterns():
        negated, pat = line.startswith("!"), line.lstrip("!").strip("/")
        if "/" in pat:
            hit = any(fnmatch.fnmatch("/".join(parts[: i + 1]), pat) for i in range(len(parts)))
        else:
            hit = any(fnmatch.fnmatch(part, pat) for part in parts)
        if hit:
            ignored = not negated
    return ignored


def path_exists(path: str) -> bool:
    p = path.rstrip("/")
    if any(c in p for c in "*?["):
        return any(fnmatch.fnmatch(f.rstrip("/"), p) for f in repo_files())
    return p in repo_files() or p + "/" in repo_files()


@functools.cache
def py_source(rel: str) -> str:
    return (REPO / rel).read_text(errors="replace")


def module_file(module: str) -> str | None:
    """repo-relative file that `python -m module` runs, else None."""
    base = module.replace(".", "/")
    if base + ".py" in repo_files():
        return base + ".py"
    if base + "/__main__.py" in repo_files():
        return base + "/__main__.py"
    return None


def module_source_file(module: str) -> str | None:
    """repo-relative file of an importable module or package."""
    base = module.replace(".", "/")
    for cand in (base + ".py", base + "/__init__.py"):
        if cand in repo_files():
            return cand
    return base + "/" if base + "/" in repo_files() else None  # a namespace package


@functools.cache
def python_roots() -> frozenset[str]:
    return frozenset(
        r
        for r in roots()
        if r + "/__init__.py" in repo_files() or (r + "/" in repo_files() and r.isidentifier())
    )


FLAG_RE = re.compile(r"""add_argument\(\s*((?:[rbf]?["'][^"']*["']\s*,\s*)*[rbf]?["'][^"']*["'])""")
IMPORT_RE = re.compile(r"^\s*from\s+([\w.]+)\s+import\s+([\w\s,()*]+?)(?:#.*)?$", re.M)
# a module kept under its old name that hands over without importing main: `import x.y as m`,
# runpy.run_module("x.y"), importlib.import_module("x.y")
HANDOVER_RE = re.compile(r"""^\s*import\s+([\w.]+)|(?:run_module|import_module)\(\s*["']([\w.]+)["']""", re.M)


@functools.cache
def module_flags(module: str, depth: int = 3) -> frozenset[str]:
    """Options the module's argparse accepts: its own add_argument strings and those of the modules
    whose `main` it hands over to (`from launch.planning.reports.simulate import main`), lazily or not."""
    rel = module_file(module) or module_source_file(module)
    if rel is None or rel.endswith("/"):
        return frozenset()
    src = py_source(rel)
    flags = {"--help", "-h"}
    for m in FLAG_RE.finditer(src):
        for s in re.findall(r"""["']([^"']*)["']""", m.group(1)):
            if s.startswith("-"):
                flags.add(s)
                if "BooleanOptionalAction" in src and s.startswith("--"):
                    flags.add("--no-" + s[2:])
    if depth:
        own = FLAG_RE.search(src) is not None
        for m in IMPORT_RE.finditer(src):
            names = m.group(2)
            target = m.group(1)
            if target.split(".")[0] in python_roots() and ("main" in names or not own):
                flags |= module_flags(target, depth - 1)
        if not own:
            for m in HANDOVER_RE.finditer(src):
                target = m.group(1) or m.group(2)
                if target.split(".")[0] in python_roots():
                    flags |= module_flags(target, depth - 1)
    return frozenset(flags)


def is_hydra(module: str) -> bool:
    rel = module_file(module)
    return rel is not None and "hydra.main(" in py_source(rel)


@functools.cache
def basenames() -> frozenset[str]:
    return frozenset(f.rstrip("/").rsplit("/", 1)[-1] for f in repo_files())


@functools.cache
def dir_names() -> frozenset[str]:
    return frozenset(part for f in repo_files() if f.endswith("/") for part in f.strip("/").split("/"))


@functools.cache
def code_words() -> frozenset[str]:
    """The upper-case words of everything but the docs: where a variable a doc shows must appear."""
    exts = (".py", ".yaml", ".yml", ".sbatch", ".sh", ".txt", ".cfg", ".toml", ".jinja", ".j2", ".in")
    names = [f for f in repo_files() if f.endswith(exts) or f in ("Makefile", ".ci/run")]
    # the checker and its test name stale examples (VLLM_INSTALL): they are not the code
    names = [f for f in names if "docs_check" not in py_source(f)]
    return frozenset(w for f in names for w in re.findall(r"\b[A-Z][A-Z0-9_]+\b", py_source(f)))


@functools.cache
def extensions() -> frozenset[str]:
    """File extensions (`ranks.py`, `controller.log` are files, not module.attribute)."""
    run_outputs = {"log", "pt", "jsonl", "png", "json", "md", "safetensors"}
    return frozenset(
        {f.rsplit(".", 1)[-1] for f in repo_files() if "." in f.rsplit("/", 1)[-1]} | run_outputs
    )


def defines(src: str, name: str, anywhere: bool = False) -> bool:
    indent = r"[ \t]*" if anywhere else ""
    pat = rf"^{indent}(?:async\s+def|def|class)\s+{name}\b|^{indent}{name}\s*[:=]|^{indent}(?:from\s+\S+\s+)?import\b[^\n]*\b{name}\b|\bself\.{name}\s*[:=]|^\s+{name},?$"
    return re.search(pat, src, re.M) is not None


@functools.cache
def defined_tests() -> frozenset[str]:
    pat = re.compile(r"^\s*(?:async\s+)?def\s+(test_\w+)", re.M)
    return frozenset(
        n
        for f in repo_files()
        if f.startswith("tests/") and f.endswith(".py")
        for n in pat.findall(py_source(f))
    )


@functools.cache
def class_files() -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for f in repo_files():
        if f.endswith(".py"):
            for name in re.findall(r"^\s*class\s+(\w+)", py_source(f), re.M):
                out.setdefault(name, []).append(f)
    return {k: tuple(v) for k, v in out.items()}
