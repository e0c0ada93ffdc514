"""The configuration reference, generated from the dataclasses: every key, its default and its
comment. `python -m areal_jobs.config.reference > docs/config-reference.md`; a unit test
regenerates it and compares it with the committed file.

The comment of a field is the one its own line ends with (any line of a field written over
several), else the comment block right above it, joined into one line. Defaults come from the
dataclasses themselves (JobConfig()), so the reference shows what a run gets without overrides;
YAML presets (conf/trainer/*.yaml, conf/experiment/*.yaml) change some of them, as the header says.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import typing
from functools import cache
from pathlib import Path

from areal_jobs.config.job import JobConfig

COMMAND = "python -m areal_jobs.config.reference > docs/config-reference.md"


@cache
def _comments(path: str) -> dict[int, str]:
    """Line number -> the comment on it, for one source file."""
    source = Path(path).read_text()
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}


@cache
def _lines(path: str) -> list[str]:
    return Path(path).read_text().splitlines()


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its one-line comment, read from the class's source."""
    path = inspect.getsourcefile(cls)
    comments, lines = _comments(path), _lines(path)
    tree = ast.parse(Path(path).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        trailing = [comments[i] for i in range(stmt.lineno, stmt.end_lineno + 1) if i in comments]
        if trailing:
            out[stmt.target.id] = trailing[0]
            continue
        out[stmt.target.id] = _comment_above(stmt.target.id, stmt.lineno - 1, node.lineno, lines, comments)
    return out


def _comment_above(name: str, line: int, stop: int, lines: list[str], comments: dict[int, str]) -> str:
    """The comment block right above a field; else, among the fields written with it (no blank
    line between), a block or a trailing comment that names it (`# ... reward_bias ...` above a
    group; `mis_low: ...  # ... [mis_low, mis_high]`)."""
    block: list[str] = []
    adjacent = True
    while line > stop and lines[line - 1].strip():
        if lines[line - 1].strip().startswith("#"):
            block.insert(0, comments.get(line, ""))
        else:
            if block:
                break
            adjacent = False
            owner = re.match(r"\s*(\w+)\s*:", lines[line - 1])
            # a neighbour's comment about both fields (`mis_low: ...  # ... [mis_low, mis_high]`),
            # not one that only uses this field's name as a word
            if (
                line in comments
                and owner
                and _names(owner[1], comments[line])
                and _names(name, comments[line])
            ):
                return comments[line]
        line -= 1
    text = " ".join(c for c in block if c)
    return text if adjacent or _names(name, text) else ""


def _names(name: str, text: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", text) is not None


def member_comments(cls: type[enum.Enum]) -> dict[str, str]:
    """Enum member -> its comment (trailing, or the block right above it)."""
    path = inspect.getsourcefile(cls)
    comments, lines = _comments(path), _lines(path)
    node = next(
        n
        for n in ast.walk(ast.parse(Path(path).read_text()))
        if isinstance(n, ast.ClassDef) and n.name == cls.__name__
    )
    out = {}
    for stmt in node.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            trailing = [comments[i] for i in range(stmt.lineno, stmt.end_lineno + 1) if i in comments]
            above, line = [], stmt.lineno - 1
            while line > node.lineno and lines[line - 1].strip().startswith("#"):
                above.insert(0, comments.get(line, ""))
                line -= 1
            out[stmt.targets[0].id] = trailing[0] if trailing else " ".join(c for c in above if c)
    return out


def _value(value: object) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict | list | tuple):
        return json.dumps(value if not isinstance(value, tuple) else list(value), default=str)
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rows(obj: object, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, default, choices, comment) for every leaf field under `obj`, in declaration order;
    nested dataclasses (reward.model, model.lora, ...) are walked into."""
    comments = field_comments(type(obj))
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out += rows(value, key + ".")
            continue
        comment = comments.get(f.name, "")
        choices = ""
        if isinstance(value, enum.Enum):
            choices = " \\| ".join(str(m.value) for m in type(value))
            if not comment:  # the Enum's docstring says what the choice is about
                comment = " ".join((type(value).__doc__ or "").split("\n\n")[0].split())
            if not comment and any(member_comments(type(value)).values()):
                comment = "one of the choices listed below the table"
        out.append((key, _value(value), choices, comment))
        element = _list_element(type(obj), f.name)
        if element is not None:  # a list of dataclasses (data.sources): each item's fields
            out += rows(element(), key + ".<i>.")
    return out


def _list_element(cls: type, name: str) -> type | None:
    """The dataclass a `list[X]` field holds, or None."""
    hint = typing.get_type_hints(cls).get(name)
    if typing.get_origin(hint) is list:
        (arg,) = typing.get_args(hint) or (None,)
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _enum_at(obj: object, dotted: str) -> type[enum.Enum]:
    owner, field_name = obj, ""
    for name in dotted.split("."):
        if name == "<i>":  # an item of the list field just walked: a default instance
            obj = _list_element(type(owner), field_name)()
        else:
            owner, field_name, obj = obj, name, getattr(obj, name)
    return type(obj)


def render() -> str:
    job = JobConfig()
    parts = [
        "# Configuration reference",
        "",
        f"Generated from the dataclasses in `areal_jobs/config/` by `{COMMAND}`;",
        "a unit test fails when this file is out of date. Every key is a Hydra override",
        '(`make run OVERRIDES="data.dataset=gsm8k data.train_path=..."`). The defaults are the',
        "schema's: presets (`trainer=megatron`, `cluster=h800`, `experiment=...` in `conf/`) change some.",
        "Choices are listed for the keys that take one of a fixed set.",
    ]
    for f in dataclasses.fields(job):
        section = getattr(job, f.name)
        doc = textwrap.dedent(type(section).__doc__ or "").strip().split("\n\n")[0]
        parts += ["", f"## {f.name}", "", " ".join(doc.split()), ""]
        parts += ["| key | default | choices | what it does |", "| --- | --- | --- | --- |"]
        notes = []
        for key, default, choices, comment in rows(section, f.name + "."):
            parts.append(f"| `{key}` | `{_cell(default)}` | {choices} | {_cell(comment)} |")
            if choices:
                notes.append((key, _enum_at(section, key.removeprefix(f.name + "."))))
        for key, enum_type in notes:
            described = [(m, c) for m, c in member_comments(enum_type).items() if c]
            if described:
                parts += ["", f"`{key}`:"] + [f"- `{m}`: {c}" for m, c in described]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
