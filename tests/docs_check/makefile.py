"""The Makefile as text: its targets, variables and recipes, and make's expansion of a recipe."""

from __future__ import annotations

import dataclasses
import functools
import re

from docs_check.tree import REPO


@dataclasses.dataclass
class Makefile:
    targets: set[str]
    variables: dict[str, str]  # name -> default text ("" when only used)
    recipes: dict[str, list[str]]


@functools.cache
def makefile() -> Makefile:
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    targets: set[str] = set()
    variables: dict[str, str] = {}
    recipes: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("\t"):
            for t in current:
                recipes.setdefault(t, []).append(line.strip())
            continue
        m = re.match(r"^(?:export\s+|override\s+)?([A-Za-z_][\w]*)\s*(\?=|:=|::=|\+=|=)\s*(.*)$", line)
        if m:
            variables[m.group(1)] = m.group(3).strip()
            current = []
            continue
        m = re.match(r"^([\w.%/ -]+?)\s*::?(?!=)\s*(.*)$", line)
        if m and not line.startswith("#"):
            current = [t for t in m.group(1).split() if not t.startswith(".")]
            targets.update(current)
            continue
        if line.strip() and not line.startswith("#"):
            current = []
    for name in re.findall(r"\$[({]([A-Za-z_]\w*)[)}]", text):
        variables.setdefault(name, "")
    return Makefile(targets, variables, recipes)


def make_expand(text: str, given: dict[str, str], target: str, depth: int = 0) -> str:
    """Expand $(VAR), $(if), $(filter), $(filter-out), $(findstring) the way make would, with the
    variables given on the command line (placeholders, so their commas and quotes are not parsed)."""
    mk = makefile()
    text = text.replace("$@", target)
    for _ in range(50):
        m = re.search(r"\$\(([^$()]*)\)", text)
        if not m:
            break
        body = m.group(1)
        fn, _, args = body.partition(" ")
        if fn == "if":
            cond, _, rest = args.partition(",")
            then, _, other = rest.partition(",")
            val = then if cond.strip() else other
        elif fn in ("filter", "filter-out"):
            pats, _, words = args.partition(",")
            keep = [w for w in words.split() if (w in pats.split()) == (fn == "filter")]
            val = " ".join(keep)
        elif fn == "findstring":
            needle, _, hay = args.partition(",")
            val = needle if needle in hay else ""
        elif fn == "shell":
            val = ""
        elif body in given:
            val = f"\x00{body}\x00"
        elif body in mk.variables and depth < 5:
            val = make_expand(mk.variables[body], given, target, depth + 1)
        else:
            val = ""
        text = text[: m.start()] + val + text[m.end() :]
    return text
