"""Hydra overrides against the JobConfig dataclass tree and the config groups of conf/."""

from __future__ import annotations

import difflib
import enum
import functools
import re
import typing

from areal_jobs.config.keys import unwrap_optional
from docs_check.tree import repo_files


@functools.cache
def config_schema() -> tuple[dict[str, typing.Any], frozenset[str]]:
    """Dotted key -> type of JobConfig (nested dataclasses expanded), and the conf/ group paths."""
    from areal_jobs.config import JobConfig, schema_keys

    groups = frozenset(
        f.rstrip("/")[len("conf/") :]
        for f in repo_files()
        if f.startswith("conf/") and f.endswith("/") and f.count("/") > 1
    )
    return schema_keys(JobConfig), groups


def key_known(key: str) -> typing.Any:
    """The type of `key`, `True` for a key under a dict or list field, None when unknown: the
    rule launch.local's override check applies (areal_jobs/config/keys.py)."""
    from areal_jobs.config.keys import key_type

    return key_type(key, config_schema()[0])


OVERRIDE_RE = re.compile(r"^([+~]{0,2})([A-Za-z_][\w]*(?:[./][\w]+)*)(?:@[\w.]+)?=(.*)$")


def override_root_is_config(key: str) -> bool:
    keys, groups = config_schema()
    first = re.split(r"[./]", key)[0]
    return first in {k.split(".")[0] for k in keys} or first in {g.split("/")[0] for g in groups}


def check_override(token: str) -> str | None:
    """None when `token` (key=value) is a real key with an allowed value, else what is wrong."""
    m = OVERRIDE_RE.match(token)
    if not m:
        return None
    _, key, value = m.groups()
    if key == "hydra" or key.startswith("hydra.") or "<" in key or key.isupper():  # KEY=VALUE
        return None
    keys, groups = config_schema()
    choices = [v for v in value.strip("'\"").rstrip(".,;:").split("|") if v]
    placeholder = any(c in value for c in "<>${}…") or value in ("...", "") or value.isupper()  # NAME
    if key in groups:
        if placeholder:
            return None
        for choice in choices:
            if f"conf/{key}/{choice}.yaml" not in repo_files():
                have = sorted(
                    f.rsplit("/", 1)[1][:-5]
                    for f in repo_files()
                    if re.fullmatch(rf"conf/{re.escape(key)}/[^/]+\.yaml", f)
                )
                return f"config group `{key}` has no choice `{choice}` (conf/{key}/: {', '.join(have)})"
        return None
    tp = key_known(key)
    if tp is None:
        near = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.75)
        hint = f"; did you mean `{near[0]}`?" if near else ""
        return f"`{key}` is not a configuration key (areal_jobs/config JobConfig){hint}"
    tp = unwrap_optional(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum) and not placeholder:
        allowed = {e.name for e in tp} | {str(e.value) for e in tp}
        for choice in choices:
            if choice not in allowed:
                return f"`{key}` takes one of {sorted({str(e.value) for e in tp})}, not `{choice}`"
    return None
