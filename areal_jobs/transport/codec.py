"""The one codec for everything on the wire. No pickle: JSON headers plus raw arrays.

Control message: one frame, JSON `{"schema": 1, "kind": "<class>", "token": "...", "body": {...}}`.
Trajectory group (multipart, DESIGN.md section 3):
  frame 0  JSON header: schema, kind, token, group fields, one entry per sample (lengths, reward...)
  frame 1  prompt token ids           int32   little-endian [p]
  frame 2  output token ids           int32   [sum n_i], samples back to back
  frame 3  behaviour log-probs        float32 [sum n_i]
  frame 4  per-token policy versions  int32   [sum n_i]
  frame 5  loss masks                 uint8   [sum n_i over samples with "has_loss_mask": 1];
           only when some sample has one (episodes with environment tokens), so a single-turn
           group is the same 5 frames it always was
Every decode checks the schema version, the job token and every length, and raises
`MessageError` naming what is wrong. A malformed message is rejected, never half-applied.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import types
import typing
from typing import Any

import numpy as np

from areal_jobs.transport import messages as m

_KINDS: dict[str, type] = {cls.__name__: cls for cls in m.CONTROL_MESSAGES}
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_U8 = np.dtype("u1")
_MAX_HEADER_BYTES = 16 << 20


class MessageError(ValueError):
    """A message that cannot be accepted: wrong schema, wrong token, or malformed fields."""


# ------------------------------------------------------------------------------ control


def encode_control(msg: m.ControlMessage, token: str) -> bytes:
    if type(msg).__name__ not in _KINDS:
        raise TypeError(f"not a control message: {type(msg).__name__}")
    body = dataclasses.asdict(msg)
    return json.dumps(
        {"schema": m.SCHEMA_VERSION, "kind": type(msg).__name__, "token": token, "body": body}
    ).encode()


def decode_control(frame: bytes, token: str) -> m.ControlMessage:
    head = _parse_json(frame, "control message")
    _check_envelope(head, token)
    kind = head.get("kind")
    cls = _KINDS.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise MessageError(f"unknown control message kind {kind!r}; expected one of {sorted(_KINDS)}")
    return _build(cls, head.get("body"), kind)


# ------------------------------------------------------------------------------ trajectories


def encode_group(group: m.TrajectoryGroup, token: str) -> list[bytes]:
    samples = [
        {
            "sample_id": s.sample_id,
            "num_tokens": s.num_tokens,
            "reward": float(s.reward),
            "reward_status": s.reward_status,
            "finish_reason": s.finish_reason,
            "num_interruptions": int(s.num_interruptions),
            "num_turns": int(s.num_turns),
            "num_tool_calls": int(s.num_tool_calls),
            "has_loss_mask": int(s.loss_mask is not None),  # int: the codec refuses JSON booleans
            "has_routes": int(s.routes is not None),
        }
        for s in group.samples
    ]
    header = {
        "schema": m.SCHEMA_VERSION,
        "kind": "TrajectoryGroup",
        "token": token,
        "group_id": group.group_id,
        "data_index": int(group.data_index),
        "attempt": int(group.attempt),
        "source": group.source,
        "num_prompt_tokens": int(group.prompt_ids.shape[0]),
        "gen_time_s": float(group.gen_time_s),
        "reward_time_s": float(group.reward_time_s),
        "dtypes": {"ids": "<i4", "logprobs": "<f4", "versions": "<i4"},
        "samples": samples,
    }

    def cat(arrays: list[np.ndarray], dtype: np.dtype) -> bytes:
        if not arrays:
            return b""
        return np.concatenate([np.asarray(a, dtype=dtype).reshape(-1) for a in arrays]).tobytes()

    frames = [
        json.dumps(header).encode(),
        np.asarray(group.prompt_ids, dtype=_I32).tobytes(),
        cat([s.output_ids for s in group.samples], _I32),
        cat([s.logprobs for s in group.samples], _F32),
        cat([s.versions for s in group.samples], _I32),
    ]
    masks = [s.loss_mask for s in group.samples if s.loss_mask is not None]
    frames += [cat(masks, _U8)] if masks else []
    routed = [s.routes for s in group.samples if s.routes is not None]
    if routed:  # [p + n, layers, top_k] per routed sample, back to back (transport/routes.py)
        header["routes"] = {
            "layers": routed[0].shape[1],
            "top_k": routed[0].shape[2],
            "dtype": routed[0].dtype.name,
        }
        frames[0] = json.dumps(header).encode()
        frames.append(cat(routed, np.dtype(routed[0].dtype).newbyteorder("<")))
    return frames


def decode_group(frames: list[bytes], token: str) -> m.TrajectoryGroup:
    if len(frames) not in (5, 6, 7):
        raise MessageError(
            "trajectory message needs 5 frames (header + 4 arrays), one more with loss masks and "
            f"one more with expert routes; got {len(frames)}"
        )
    head = _parse_json(frames[0], "trajectory header")
    _check_envelope(head, token)
    if head.get("kind") != "TrajectoryGroup":
        raise MessageError(f"expected kind 'TrajectoryGroup', got {head.get('kind')!r}")
    if head.get("dtypes") != {"ids": "<i4", "logprobs": "<f4", "versions": "<i4"}:
        raise MessageError(f"unsupported array dtypes {head.get('dtypes')!r}")
    samples = head.get("samples")
    if not isinstance(samples, list) or not samples:
        raise MessageError("trajectory header: 'samples' must be a non-empty list")
    lengths = [_field(s, "num_tokens", int, "sample") for s in samples]
    if any(n < 0 for n in lengths):
        raise MessageError(f"negative sample length in {lengths}")
    prompt = _array(frames[1], _I32, _field(head, "num_prompt_tokens", int, "header"), "prompt ids")
    total = sum(lengths)
    ids = _array(frames[2], _I32, total, "output ids")
    logprobs = _array(frames[3], _F32, total, "log-probs")
    versions = _array(frames[4], _I32, total, "versions")
    if total and (not np.all(np.isfinite(logprobs)) or float(logprobs.max()) > 1e-3):
        raise MessageError("log-probs must be finite and <= 0")
    if total and int(versions.min()) < 0:
        raise MessageError("policy versions must be >= 0")
    masked = [_field(s, "has_loss_mask", int, "sample") for s in samples]
    if any(flag not in (0, 1) for flag in masked):
        raise MessageError(f"has_loss_mask must be 0 or 1, got {masked}")
    num_masked = sum(n for n, flag in zip(lengths, masked) if flag)
    routed = [int(s.get("has_routes", 0)) for s in samples]
    if any(flag not in (0, 1) for flag in routed):
        raise MessageError(f"has_routes must be 0 or 1, got {routed}")
    if len(frames) != 5 + any(masked) + any(routed):
        raise MessageError(
            "the loss-mask frame and the route frame must each be present exactly when a sample has "
            "has_loss_mask 1, has_routes 1"
        )
    masks = _array(frames[5], _U8, num_masked, "loss masks") if any(masked) else np.zeros(0, _U8)
    route_rows = (
        _decode_routes(head, frames[-1], [n + prompt.shape[0] for n, f in zip(lengths, routed) if f])
        if any(routed)
        else []
    )
    if masks.size and int(masks.max()) > 1:
        raise MessageError("loss masks must be 0 or 1")
    out, start, mask_start = [], 0, 0
    route_iter = iter(route_rows)
    for s, n, flag, has_routes in zip(samples, lengths, masked, routed):
        end = start + n
        mask = masks[mask_start : mask_start + n] if flag else None
        mask_start += n if flag else 0
        out.append(
            m.SampleTrajectory(
                sample_id=_field(s, "sample_id", str, "sample"),
                output_ids=ids[start:end],
                logprobs=logprobs[start:end],
                versions=versions[start:end],
                reward=float(_field(s, "reward", (int, float), "sample")),
                reward_status=_field(s, "reward_status", str, "sample"),
                finish_reason=_field(s, "finish_reason", str, "sample"),
                num_interruptions=_field(s, "num_interruptions", int, "sample"),
                loss_mask=mask,
                num_turns=_field(s, "num_turns", int, "sample"),
                num_tool_calls=_field(s, "num_tool_calls", int, "sample"),
                routes=next(route_iter) if has_routes else None,
            )
        )
        start = end
    return m.TrajectoryGroup(
        group_id=_field(head, "group_id", str, "header"),
        data_index=_field(head, "data_index", int, "header"),
        prompt_ids=prompt,
        samples=tuple(out),
        gen_time_s=float(_field(head, "gen_time_s", (int, float), "header")),
        reward_time_s=float(_field(head, "reward_time_s", (int, float), "header")),
        attempt=_field(head, "attempt", int, "header"),
        source=_field(head, "source", str, "header") if "source" in head else "",
    )


# ------------------------------------------------------------------------------ helpers


def _decode_routes(head: dict[str, Any], frame: bytes, rows: list[int]) -> list[np.ndarray]:
    """The routed samples' expert ids, [p + n_i, layers, top_k] each, from the route frame."""
    spec = head.get("routes")
    if not isinstance(spec, dict) or spec.get("dtype") not in ("uint8", "uint16"):
        raise MessageError(f"trajectory header: 'routes' must name uint8 or uint16 ids, got {spec!r}")
    layers, top_k = _field(spec, "layers", int, "routes"), _field(spec, "top_k", int, "routes")
    if layers <= 0 or top_k <= 0:
        raise MessageError(f"routes need layers > 0 and top_k > 0, got {layers}, {top_k}")
    dtype = np.dtype(spec["dtype"]).newbyteorder("<")
    flat = _array(frame, dtype, sum(rows) * layers * top_k, "expert routes").astype(spec["dtype"])
    out, offset = [], 0
    for n in rows:
        out.append(flat[offset : offset + n * layers * top_k].reshape(n, layers, top_k))
        offset += n * layers * top_k
    return out


def _parse_json(frame: bytes, what: str) -> dict[str, Any]:
    if len(frame) > _MAX_HEADER_BYTES:
        raise MessageError(f"{what} is {len(frame)} bytes; the limit is {_MAX_HEADER_BYTES}")
    try:
        obj = json.loads(frame)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MessageError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise MessageError(f"{what} must be a JSON object")
    return obj


def _check_envelope(head: dict[str, Any], token: str) -> None:
    if head.get("schema") != m.SCHEMA_VERSION:
        raise MessageError(
            f"schema version {head.get('schema')!r} != {m.SCHEMA_VERSION}: "
            "controller and trainer run different areal_jobs versions"
        )
    got = head.get("token")
    if not isinstance(got, str) or not hmac.compare_digest(got.encode(), token.encode()):
        raise MessageError("message refused: missing or wrong job token")


def _field(obj: Any, name: str, types_: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or name not in obj:
        raise MessageError(f"{where}: missing field {name!r}")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, types_):
        raise MessageError(f"{where}.{name}: expected {types_}, got {type(value).__name__}")
    return value


def _array(frame: bytes, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    if len(frame) != count * dtype.itemsize:
        raise MessageError(f"{what}: {len(frame)} bytes, expected {count} x {dtype.itemsize}")
    return np.frombuffer(frame, dtype=dtype).astype(dtype.newbyteorder("="), copy=True)


def _build(tp: Any, value: Any, where: str) -> Any:
    """Construct `tp` from decoded JSON, checking every field's type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _build(option, value, where)
            except MessageError:
                continue
        raise MessageError(f"{where}: {value!r} matches none of {tp}")
    if tp is type(None):
        if value is not None:
            raise MessageError(f"{where}: expected null")
        return None
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise MessageError(f"{where}: expected an object for {tp.__name__}")
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = _build(hints[f.name], value[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MessageError(f"{where}: missing field {f.name!r}")
        unknown = set(value) - {f.name for f in dataclasses.fields(tp)}
        if unknown:
            raise MessageError(f"{where}: unknown fields {sorted(unknown)}")
        return tp(**kwargs)
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise MessageError(f"{where}: expected a list")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        items = [_build(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise MessageError(f"{where}: expected an object")
        _, vt = typing.get_args(tp)
        return {str(k): _build(vt, v, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MessageError(f"{where}: expected a number, got {type(value).__name__}")
        return float(value)
    if tp in (int, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise MessageError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    if tp is Any:
        return value
    raise MessageError(f"{where}: unsupported field type {tp}")
