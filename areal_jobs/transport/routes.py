"""Expert routes of a mixture of experts, from the engine to the trainer (routing replay). Pure numpy.

A sample's routes are one array `[p + n, layers, top_k]` over its prompt and output positions
(uint8; uint16 with 255 or more experts), where a row of the dtype's all-ones value means "no
route reported": the trainer routes that position itself. Rows missing are: the last output
token (never an input), a prompt prefix the engine served from its prefix cache, and a dense
layer's column of a model with dense layers.

On the way the routes are a list of segments, one per generate call (api.ExpertRoutes, kept in
the episode state as JSON: checkpoints stay plain JSON). A generation continued after an
interruption keeps each position's routes as first reported: the new call's rows only count from
the end of what earlier calls covered, so a token keeps the routes of the weights that sampled it.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import numpy as np

from areal_jobs.api import ExpertRoutes

DTYPES = ("uint8", "uint16")


def no_route(dtype: np.dtype | str) -> int:
    """The fill value of a row without routes (the dtype's all-ones value)."""
    return int(np.iinfo(np.dtype(dtype)).max)


def route_dtype(num_experts: int) -> np.dtype:
    """The narrowest dtype that holds every expert id and still leaves the fill value free."""
    if num_experts < 255:
        return np.dtype(np.uint8)
    if num_experts < 65535:
        return np.dtype(np.uint16)
    raise ValueError(f"{num_experts} experts: routing replay supports at most 65,534")


def from_engine(payload: dict) -> ExpertRoutes:
    """A worker's JSON answer (rollout/vllm_routes.py: start, shape, dtype, base64 data) -> ExpertRoutes."""
    if payload.get("dtype") not in DTYPES:
        raise ValueError(f"route dtype {payload.get('dtype')!r}: expected one of {DTYPES}")
    shape = tuple(int(x) for x in payload["shape"])
    if len(shape) != 3 or int(payload["start"]) < 0:
        raise ValueError(
            f"routes need shape [rows, layers, top_k] and start >= 0, got {shape}, {payload['start']}"
        )
    data = base64.b64decode(payload["data"])
    ids = np.frombuffer(data, dtype=np.dtype(payload["dtype"]).newbyteorder("<")).reshape(shape)
    return ExpertRoutes(int(payload["start"]), ids.astype(payload["dtype"]))


def to_json(routes: ExpertRoutes) -> list:
    """[start, rows, layers, top_k, dtype, base64]: a segment as the episode state keeps it."""
    ids = np.ascontiguousarray(routes.ids, dtype=np.dtype(routes.ids.dtype).newbyteorder("<"))
    return [
        int(routes.start),
        *map(int, ids.shape),
        routes.ids.dtype.name,
        base64.b64encode(ids.tobytes()).decode(),
    ]


def from_json(entry: Sequence) -> ExpertRoutes:
    start, rows, layers, top_k, dtype, data = entry
    return from_engine({"start": start, "shape": [rows, layers, top_k], "dtype": dtype, "data": data})


def covered_end(segments: Sequence[Sequence]) -> int:
    """One past the last position the JSON segments cover (0 when none)."""
    return max((int(s[0]) + int(s[1]) for s in segments), default=0)


def add_segment(segments: list, routes: ExpertRoutes) -> None:
    """Append a generate call's routes to the JSON segments, only the rows at positions past what
    earlier calls covered (a continued generation keeps each token's routes as sampled)."""
    end = covered_end(segments)
    skip = max(0, end - routes.start)
    if skip >= routes.ids.shape[0]:
        return
    segments.append(to_json(ExpertRoutes(routes.start + skip, routes.ids[skip:])))


def assemble(segments: Sequence[Sequence], num_positions: int) -> np.ndarray | None:
    """The sample's routes `[num_positions, layers, top_k]` from its JSON segments; None without any.
    Rows past num_positions are dropped (never expected: the last token has no route)."""
    parts = [from_json(s) for s in segments]
    if not parts:
        return None
    first = parts[0].ids
    if any(p.ids.shape[1:] != first.shape[1:] or p.ids.dtype != first.dtype for p in parts):
        raise ValueError("route segments of one sample disagree on layers, top_k or dtype")
    out = np.full((num_positions, *first.shape[1:]), no_route(first.dtype), first.dtype)
    for p in parts:
        rows = p.ids[: max(0, num_positions - p.start)]
        out[p.start : p.start + rows.shape[0]] = rows
    return out


def pack(routes: Sequence[np.ndarray | None], lengths: Sequence[int]) -> np.ndarray | None:
    """Per-sample routes (None: no routes) laid out as a packed row of `lengths` (the trainer's
    padding-free forward): `[sum(lengths), layers, top_k]`; None when no sample has routes."""
    known = [r for r in routes if r is not None]
    if not known:
        return None
    shape, dtype = known[0].shape[1:], known[0].dtype
    out = np.full((int(sum(lengths)), *shape), no_route(dtype), dtype)
    offset = 0
    for r, n in zip(routes, lengths, strict=True):
        if r is not None:
            if r.shape[1:] != shape or r.dtype != dtype:
                raise ValueError("samples of one batch disagree on the routes' layers, top_k or dtype")
            rows = min(n, r.shape[0])
            out[offset : offset + rows] = r[:rows]
        offset += n
    return out


def scored_coverage(routes: np.ndarray | None, num_prompt_tokens: int) -> tuple[int, int]:
    """(scored output tokens whose predicting position has routes, scored output tokens) of one
    sample: output token i is predicted at position p + i - 1, so its experts there are replayed."""
    n = 0 if routes is None else routes.shape[0] - num_prompt_tokens
    if routes is None or n <= 0:
        return 0, max(n, 0)
    rows = routes[num_prompt_tokens - 1 : num_prompt_tokens - 1 + n]
    return int((rows != no_route(routes.dtype)).all(-1).any(-1).sum()), n
