"""Every key of the schema, and the refusal of a key it does not have, with the closest real one.

Hydra refuses `cluster.nodse=64` with a hint to write `+cluster.nodse=64`, and that spelling is let
in (Hydra opens the struct flag to add it) and then dropped without a word when the dataclasses are
built: the job runs with the default. `unknown_keys` finds such keys in a composed config
(to_job_config refuses them), `check_override_keys` in the command line before Hydra composes it,
so both spellings fail the same way and name the key that was meant (difflib).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig

_OPEN = "*"  # a dict field: any key below it is the user's (cluster.nccl_env.NCCL_DEBUG)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_dict(tp: Any) -> bool:
    return typing.get_origin(tp) in (dict, Mapping) or tp is dict


def schema_keys(cls: type, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> type for every field of the dataclass `cls` (nested dataclasses expanded)."""
    out: dict[str, Any] = {}
    for name, tp in _field_types(cls).items():
        key = f"{prefix}{name}"
        out[key] = tp
        if dataclasses.is_dataclass(tp):
            out.update(schema_keys(tp, key + "."))
    return out


def unwrap_optional(tp: Any) -> Any:
    """`X | None` -> X (an optional dict or list field takes keys below it like a required one)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1 else tp


def key_type(key: str, keys: Mapping[str, Any]) -> Any:
    """The type of `key` in `keys` (schema_keys), True for a key under a dict field (any key) or a
    list field (an index), None when the schema has no such key. The one rule both the override
    check here and the docs checker (tests/docs_check/) apply."""
    if key in keys:
        return keys[key]
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:cut])
        if parent in keys:
            tp = unwrap_optional(keys[parent])
            if _is_dict(tp):
                return True
            if typing.get_origin(tp) is not list or not parts[cut].isdigit():
                return None
            if len(parts) == cut + 1:
                return True
            # an element's field, e.g. data.sources.1.weight for a list of dataclasses
            (element,) = typing.get_args(tp) or (None,)
            if not dataclasses.is_dataclass(element):
                return None
            return key_type(".".join(parts[cut + 1 :]), schema_keys(element))
    return None


def _known(key: str, keys: Mapping[str, Any]) -> bool:
    return key_type(key, keys) is not None


def closest_key(key: str, keys: Iterable[str]) -> str | None:
    """The real key `key` most likely meant, by the similarity of the last part (a sibling wins a
    tie: cluster.nodse -> cluster.nodes; nodes -> cluster.nodes), else of the whole dotted key."""
    names = list(keys)
    parent, _, leaf = key.rpartition(".")
    best, best_score = None, 0.0
    for name in names:
        name_parent, _, name_leaf = name.rpartition(".")
        score = difflib.SequenceMatcher(None, leaf, name_leaf).ratio() + (
            0.05 if name_parent == parent else 0.0
        )
        if score > best_score:
            best, best_score = name, score
    if best_score >= 0.75:
        return best
    match = difflib.get_close_matches(key, names, n=1, cutoff=0.8)
    return match[0] if match else None


def unknown_key_message(keys: list[str], root: type) -> str:
    schema = schema_keys(root)
    parts = []
    for key in keys:
        near = closest_key(key, schema)
        parts.append(f"{key} (did you mean {near}?)" if near else key)
    return (
        f"unknown configuration key{'s' if len(keys) > 1 else ''}: {', '.join(parts)}. The schema is "
        "areal_jobs/config/; `--cfg job` prints every key with its value"
    )


def unknown_keys(cfg: DictConfig | Mapping[str, Any], root: type) -> list[str]:
    """Dotted keys of `cfg` the dataclass `root` does not have (Hydra's own `hydra` node aside)."""
    keys = schema_keys(root)
    found: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else node.items()
        for name, value in items:
            key = f"{prefix}{name}"
            if not prefix and name == "hydra":
                continue
            if not _known(key, keys):
                found.append(key)
                continue
            if key in keys and _is_dict(keys[key]):
                continue  # the user's own keys below
            if isinstance(value, (DictConfig, dict)) and not isinstance(value, ListConfig):
                walk(value, key + ".")

    walk(cfg, "")
    return found


def check_override_keys(overrides: Iterable[str], conf_dir: Path, root: type) -> None:
    """Raise ValueError for a command-line override of a key the schema lacks, in any spelling
    (`key=`, `+key=`, `++key=`, `~key`). Group choices (`cluster=h800`, `rollout/engine=vllm`:
    a directory under conf/), Hydra's own options and flags are left to Hydra."""
    keys = schema_keys(root)
    bad = []
    for arg in overrides:
        if arg.startswith("-") or "=" not in arg and not arg.startswith("~"):
            continue
        key = arg.split("=", 1)[0].lstrip("+~").split("@", 1)[0]
        if not key or key.startswith("hydra.") or key == "hydra" or "/" in key:
            continue
        if (conf_dir / key).is_dir():
            continue  # a config group
        if not _known(key, keys):
            bad.append(key)
    if bad:
        raise ValueError(unknown_key_message(bad, root))
