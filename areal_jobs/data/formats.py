"""Reading row files in the formats the field uses: Parquet, JSON, JSONL, `datasets` directories.

    data.format=auto   by the path: a directory -> hf_disk; .parquet -> parquet; .jsonl -> jsonl;
                       any other name by its content: Parquet's magic bytes -> parquet, a file
                       opening with '[' -> json (a list of rows), else jsonl (what
                       `Dataset.to_json` writes under .json, and every JSONL file before)
    parquet            pyarrow.parquet (verl's train.parquet / test.parquet)
    json               one JSON list of row objects
    jsonl              one JSON object per line; a line that does not parse is a bad row
    hf_disk            datasets.load_from_disk: a Dataset directory, or one split of a DatasetDict

The libraries read the files (nothing here parses a format by hand); this module only says where
each row came from (`path:line` for JSONL, `path:row N` otherwise) so a bad row is reported at its
place. Values are plain Python (pyarrow and `datasets` give lists and dicts for nested columns).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from areal_jobs.config.data import DataFormat


class BadRow(ValueError):
    """A row that cannot be used at all (e.g. a JSONL line that is not JSON)."""


def detect_format(path: str, key: str = "data.train_path") -> DataFormat:
    """The format of `path` under data.format=auto; errors name the override that fixes them."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{key}={path}: no such file or directory")
    if p.is_dir():
        return DataFormat.hf_disk
    suffix = p.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return DataFormat.parquet
    if suffix == ".jsonl":
        return DataFormat.jsonl
    with p.open("rb") as f:  # .json or another name: by the content
        head = f.read(4096)
    if head.startswith(b"PAR1"):
        return DataFormat.parquet
    return DataFormat.json if head.lstrip().startswith(b"[") else DataFormat.jsonl


def read_records(path: str, fmt: DataFormat, key: str = "data.train_path") -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of the file in order; `row` is whatever the file holds (a dict
    for a well-formed file) or a BadRow for a JSONL line that does not parse."""
    if fmt is DataFormat.auto:
        fmt = detect_format(path, key)
    elif not Path(path).exists():
        raise FileNotFoundError(f"{key}={path}: no such file or directory")
    if fmt is DataFormat.jsonl:
        yield from _jsonl(path)
    elif fmt is DataFormat.json:
        with open(path, encoding="utf-8") as f:
            try:
                rows = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{key}={path} is not one JSON document ({exc}); JSON lines need data.format=jsonl"
                ) from None
        if not isinstance(rows, list):
            raise ValueError(f"{key}={path} holds a JSON {type(rows).__name__}, not a list of rows")
        yield from ((f"{path}:row {i}", row) for i, row in enumerate(rows, start=1))
    elif fmt is DataFormat.parquet:
        import pyarrow.parquet as pq  # lazy: only for Parquet files

        table = pq.read_table(path)
        yield from ((f"{path}:row {i}", row) for i, row in enumerate(table.to_pylist(), start=1))
    elif fmt is DataFormat.hf_disk:
        yield from _hf_disk(path, key)
    else:
        raise ValueError(f"unknown data.format={fmt}")


def _jsonl(path: str) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as exc:
                yield f"{path}:{lineno}", BadRow(f"JSONDecodeError: {exc}")


def _hf_disk(path: str, key: str) -> Iterator[tuple[str, Any]]:
    import datasets  # lazy: heavy, and only for save_to_disk directories

    try:
        loaded = datasets.load_from_disk(path)
    except FileNotFoundError as exc:
        raise ValueError(f"{key}={path} is not a directory written by save_to_disk ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        raise ValueError(
            f"{key}={path} is a DatasetDict with splits {splits}: point at one split's directory, "
            f"e.g. {key}={Path(path) / splits[0]}"
        )
    yield from ((f"{path}:row {i}", row) for i, row in enumerate(loaded.to_list(), start=1))


_MISSING = object()


def get_field(row: dict, key: str) -> Any:
    """row[key], where dots reach nested objects (`reward_model.ground_truth`); a column literally
    named with a dot wins. KeyError names the missing part."""
    if key in row:
        return row[key]
    node: Any = row
    walked = []
    for part in key.split("."):
        value = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if value is _MISSING or value is None and part != key.split(".")[-1]:
            where = f" in {'.'.join(walked)!r}" if walked else ""
            raise KeyError(f"field {key!r} is missing (no {part!r}{where})")
        walked.append(part)
        node = value
    return node


def has_field(row: dict, key: str) -> bool:
    try:
        get_field(row, key)
    except KeyError:
        return False
    return True


def plain(value: Any) -> Any:
    """A JSON-serialisable copy (numpy/pyarrow scalars, dates and bytes become text or numbers)."""
    return json.loads(json.dumps(value, default=_default))


def _default(value: Any) -> Any:
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        return item()
    tolist = getattr(value, "tolist", None)  # numpy arrays
    if callable(tolist):
        return tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)
