"""docs/config-reference.md is generated from the dataclasses (areal_jobs/config/reference.py) and
kept current: regenerated here and compared with the committed file."""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path

from areal_jobs.config import JobConfig, schema_keys
from areal_jobs.config.reference import COMMAND, field_comments, render, rows

REPO = Path(__file__).resolve().parents[3]
COMMITTED = REPO / "docs" / "config-reference.md"


def test_the_committed_reference_is_current() -> None:
    assert COMMITTED.read_text() == render(), f"docs/config-reference.md is out of date: run `{COMMAND}`"


def test_every_key_is_there_with_its_default() -> None:
    text = render()
    listed = dict(re.findall(r"^\| `([a-z_.0-9<>]+)` \| `(.*?)` \|", text, flags=re.M))
    leaves = {k for k, tp in schema_keys(JobConfig).items() if not dataclasses.is_dataclass(tp)}
    assert {k for k in listed if "<i>" not in k} == leaves  # <i>: the items of a list of dataclasses
    assert listed["reward.function"] == '""' and listed["reward.function_isolation"] == "process"
    assert listed["checkpoint.resume"] == "true" and listed["data.dataset"] == "arith"
    # data.dataset's choices, each with what it reads
    assert "- `gsm8k`: GSM8K-style JSONL" in text


def test_comments_come_from_the_line_or_the_block_above(tmp_path: Path, monkeypatch) -> None:
    source = tmp_path / "sample_cfg.py"
    source.write_text(
        "from dataclasses import dataclass\n\n\n@dataclass\nclass Sample:\n"
        "    a: int = 1  # trailing\n"
        "    # above, line one\n    # line two\n    b: int = 2\n\n"
        "    c: int = 3\n"
        "    # shared by d_low and d_high\n    d_low: int = 4\n    d_high: int = 5\n"
        "    e: int = 6\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from sample_cfg import Sample

    assert field_comments(Sample) == {
        "a": "trailing",
        "b": "above, line one line two",
        "c": "",
        "d_low": "shared by d_low and d_high",
        "d_high": "shared by d_low and d_high",
        "e": "",  # a block above its group that does not name it
    }


class Mode(enum.Enum):
    a = "a"  # the first
    b = "b"


@dataclasses.dataclass
class Item:
    name: str = ""  # the item's name
    mode: Mode = Mode.a


@dataclasses.dataclass
class Holder:
    items: list[Item] = dataclasses.field(default_factory=list)  # several items


def test_a_list_of_dataclasses_lists_its_items_fields() -> None:
    assert rows(Holder(), "h.") == [
        ("h.items", "[]", "", "several items"),
        ("h.items.<i>.name", '""', "", "the item's name"),
        ("h.items.<i>.mode", "a", "a \\| b", "one of the choices listed below the table"),
    ]
