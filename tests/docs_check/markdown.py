"""A doc as code snippets (fenced and indented blocks, inline spans) and prose, and the commands in them."""

from __future__ import annotations

import dataclasses
import functools
import re
import shlex
from collections.abc import Iterator

from docs_check.tree import REPO, repo_files


def docs() -> list[str]:
    out = ["README.md"] + sorted(f for f in repo_files() if re.fullmatch(r"docs/.+\.md", f))
    out += sorted(
        f
        for f in repo_files()
        if f.startswith("bench/") and f.endswith("/README.md") or f == "bench/README.md"
    )
    return sorted(set(out), key=out.index)


@dataclasses.dataclass(frozen=True)
class Snippet:
    doc: str
    line: int
    text: str  # code: one logical line of a code block, or one inline code span


def history_cells_blanked(lines: list[str]) -> list[str]:
    """A table column headed `was` (what moved where: `| was | now |`) names what no longer exists
    by design; its cells are blanked, every other cell is checked."""
    out, was_cols = [], set()
    for i, line in enumerate(lines):
        cells = re.split(r"(?<!\\)\|", line)
        if not line.lstrip().startswith("|"):
            was_cols = set()
        elif i + 1 < len(lines) and re.fullmatch(r"\s*\|(\s*:?-+:?\s*\|)+\s*", lines[i + 1]):
            was_cols = {j for j, c in enumerate(cells) if re.match(r"\s*was\b", c)}
        elif was_cols:
            line = "|".join(" " * len(c) if j in was_cols else c for j, c in enumerate(cells))
        out.append(line)
    return out


@functools.cache
def split_doc(doc: str) -> tuple[tuple[Snippet, ...], str]:
    """(code snippets, the prose with code blocks blanked out, same line count)."""
    lines = history_cells_blanked((REPO / doc).read_text().splitlines())
    code: list[Snippet] = []
    prose: list[str] = []
    fence = None
    prev_blank = True
    in_indented = False
    pending: tuple[int, str] | None = None
    for i, line in enumerate(lines, 1):
        stripped = line.strip()
        if fence is None and re.match(r"^\s*(```|~~~)", line):
            fence = stripped[:3]
            prose.append("")
            continue
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            else:
                start, text = pending if pending else (i, "")
                text += " " + line.rstrip("\\").strip() if text else line.rstrip("\\").strip()
                if line.rstrip().endswith("\\"):
                    pending = (start, text)
                else:
                    pending = None
                    code.append(Snippet(doc, start, text))
            prose.append("")
            continue
        indented = line.startswith("    ") and stripped and not stripped.startswith(("-", "*", "|"))
        if indented and (prev_blank or in_indented):
            in_indented = True
            code.append(Snippet(doc, i, stripped))
            prose.append("")
            prev_blank = False
            continue
        in_indented = False
        prev_blank = not stripped
        prose.append(line)
    text = "\n".join(prose)
    for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", text, re.S):
        if "\n\n" in m.group(2):
            continue
        span = m.group(2).replace("\\|", "|").replace("\n", " ").strip()
        code.append(Snippet(doc, text.count("\n", 0, m.start()) + 1, span))
    prose_only = re.sub(
        r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S
    )
    return tuple(code), prose_only


def snippets() -> Iterator[Snippet]:
    """Every code snippet of the docs, then every line of the --help texts conf/ holds."""
    for doc in docs():
        yield from split_doc(doc)[0]
    yield from help_snippets()


@functools.cache
def help_snippets() -> tuple[Snippet, ...]:
    """The lines of each `template: |` block of conf/*.yaml (hydra.help: what `--help` prints)."""
    out = []
    for f in sorted(x for x in repo_files() if x.startswith("conf/") and x.endswith(".yaml")):
        indent = None
        for i, line in enumerate((REPO / f).read_text().splitlines(), 1):
            if indent is not None and line.strip() and len(line) - len(line.lstrip()) <= indent:
                indent = None
            if indent is not None and line.strip():
                out.append(Snippet(f, i, line.strip()))
            m = re.match(r"^(\s*)template:\s*\|", line)
            if m:
                indent = len(m.group(1))
    return tuple(out)


def tokens(text: str) -> list[str]:
    text = re.sub(r"<[^<>\n]*>", lambda m: m.group(0).replace(" ", "_"), text)  # <run dir>: one word
    try:
        return shlex.split(text, comments=False)
    except ValueError:
        return text.split()


def _cut_command(words: list[str]) -> list[str]:
    """The command's own words: up to a shell separator, a comment (`# ...`, `(what it does)`) or
    the end of a listed command (`make status JOB=<id>, make cancel ...`); `[optional]` unwrapped."""
    out = []
    for w in words:
        if w in (";", "&&", "||", "|", ")", "/", "--", "make") or w.startswith(("#", ">", "2>", "&", "(")):
            break
        w = w.rstrip(";")
        if w.startswith("[") or (w.endswith("]") and "[" not in w):
            w = w.strip("[]")
        out.append(w.rstrip(","))
        if w.endswith(","):
            break
    return out


def commands(snip: Snippet, shell_vars: dict[str, str] | None = None) -> Iterator[tuple[str, list[str]]]:
    """("make", [words after make]) and ("python", [module, args...]) found in a snippet. A shell
    variable set to a command (A="python -m x"; `shell_vars` carries them through one doc) is
    expanded where it is used ($A calibrate ...)."""
    shell_vars = {} if shell_vars is None else shell_vars
    text = re.sub(r"\s#\s.*$", "", snip.text)
    shell_vars.update(re.findall(r"""\b([A-Za-z_]\w*)=["']((?:python3?|make)\b[^"']*)["']""", text))
    for var, val in shell_vars.items():
        text = re.sub(rf"\${var}\b|\$\{{{var}\}}", val, text)
    for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", text):
        words = tokens(part)
        for i, w in enumerate(words):
            if (
                w == "make"
                and i + 1 < len(words)
                and (i == 0 or "=" in words[i - 1] or words[i - 1] in ("then", "do"))
            ):
                yield "make", _cut_command(words[i + 1 :])
                break
            if (
                re.fullmatch(r"(?:\S*/)?python3?(?:\.\d+)?", w)
                and i + 2 < len(words)
                and words[i + 1] == "-m"
            ):
                yield "python", _cut_command(words[i + 2 :])
                break
