"""The trainer's TrainBatch as bytes, for rank 0 -> the other Megatron ranks (no pickle).

Same conventions as codec.py (JSON header, raw little-endian arrays, every length checked):
  8 bytes  header length H, uint64 little-endian
  H bytes  JSON: schema, kind, batch fields, one entry per sample (ids, lengths, scalars)
  then     input ids int64 [sum L_i] | behaviour log-probs float32 [sum n_i] |
           versions int32 [sum n_i] | loss masks uint8 [sum n_i] (1 where the sample has none)
           | expert routes [sum r_i, layers, top_k] of the samples that carry them (the header's
           "routes" names layers, top_k and uint8/uint16; each sample its "route_rows" r_i, -1 = none)
No job token: the bytes travel only inside the trainer's own process group (torch.distributed),
which only this job's ranks joined; the schema version still guards mismatched code.
Expert routes (TrainSample.routes, trainer.routing_replay=rollout) travel as in codec.py's
trajectory frames, so every Megatron rank replays the same experts (megatron/routing_replay.py).
"""

from __future__ import annotations

import json

import numpy as np

from areal_jobs.api import TrainBatch, TrainSample
from areal_jobs.transport import messages as m
from areal_jobs.transport.codec import MessageError, _array, _decode_routes, _field, _parse_json

_DTYPES = {
    "input_ids": np.dtype("<i8"),
    "behav": np.dtype("<f4"),
    "versions": np.dtype("<i4"),
    "mask": np.dtype("u1"),
}


def encode_train_batch(batch: TrainBatch) -> bytes:
    samples = batch.samples
    header = {
        "schema": m.SCHEMA_VERSION,
        "kind": "TrainBatch",
        "version": int(batch.version),
        "group_ids": list(batch.group_ids),
        "filtered_group_ids": list(batch.filtered_group_ids),
        "max_new_tokens": int(batch.max_new_tokens),
        "samples": [
            {
                "sample_id": s.sample_id,
                "length": int(s.input_ids.shape[0]),
                "num_prompt_tokens": int(s.num_prompt_tokens),
                "num_output_tokens": s.num_output_tokens,
                "advantage": float(s.advantage),
                "reward": float(s.reward),
                "has_mask": int(s.loss_mask is not None),  # int: the codec refuses JSON booleans as fields
                "route_rows": -1 if s.routes is None else int(s.routes.shape[0]),
            }
            for s in samples
        ],
    }
    routed = [s.routes for s in samples if s.routes is not None]
    if routed:
        header["routes"] = {
            "layers": routed[0].shape[1],
            "top_k": routed[0].shape[2],
            "dtype": routed[0].dtype.name,
        }
        if any(r.shape[1:] != routed[0].shape[1:] or r.dtype != routed[0].dtype for r in routed):
            raise ValueError("samples of one batch disagree on the routes' layers, top_k or dtype")
    head = json.dumps(header).encode()

    def cat(arrays, dtype) -> bytes:
        return b"".join(np.asarray(a, dtype=dtype).tobytes() for a in arrays)

    return b"".join(
        [
            len(head).to_bytes(8, "little"),
            head,
            cat([s.input_ids for s in samples], _DTYPES["input_ids"]),
            cat([s.behav_logprobs for s in samples], _DTYPES["behav"]),
            cat([s.versions for s in samples], _DTYPES["versions"]),
            cat([s.mask() for s in samples], _DTYPES["mask"]),
            cat(routed, np.dtype(routed[0].dtype).newbyteorder("<")) if routed else b"",
        ]
    )


def decode_train_batch(data: bytes) -> TrainBatch:
    if len(data) < 8:
        raise MessageError("train batch: shorter than its header length")
    size = int.from_bytes(data[:8], "little")
    head = _parse_json(data[8 : 8 + size], "train batch header")
    if head.get("schema") != m.SCHEMA_VERSION or head.get("kind") != "TrainBatch":
        raise MessageError(f"train batch: schema {head.get('schema')!r} kind {head.get('kind')!r}")
    entries = _field(head, "samples", list, "train batch")
    lengths = [_field(e, "length", int, "sample") for e in entries]
    outputs = [_field(e, "num_output_tokens", int, "sample") for e in entries]
    total_ids, total_out = sum(lengths), sum(outputs)
    offset = 8 + size
    arrays = {}
    for name, count in (
        ("input_ids", total_ids),
        ("behav", total_out),
        ("versions", total_out),
        ("mask", total_out),
    ):
        nbytes = count * _DTYPES[name].itemsize
        arrays[name] = _array(data[offset : offset + nbytes], _DTYPES[name], count, name)
        offset += nbytes
    route_rows = [e.get("route_rows", -1) for e in entries]  # absent: a batch without routes
    if any(isinstance(r, bool) or not isinstance(r, int) or r < -1 for r in route_rows):
        raise MessageError(f"train batch: route_rows must be ints >= -1, got {route_rows}")
    routes = iter(())
    if any(r >= 0 for r in route_rows):
        spec = head.get("routes")
        if not isinstance(spec, dict) or spec.get("dtype") not in ("uint8", "uint16"):
            raise MessageError(f"train batch: 'routes' must name uint8 or uint16 ids, got {spec!r}")
        layers, top_k = (_field(spec, k, int, "routes") for k in ("layers", "top_k"))
        rows = [r for r in route_rows if r >= 0]
        nbytes = sum(rows) * layers * top_k * np.dtype(spec["dtype"]).itemsize
        routes = iter(_decode_routes(head, data[offset : offset + nbytes], rows))
        offset += nbytes
    if offset != len(data):
        raise MessageError(f"train batch: {len(data) - offset} trailing bytes")
    samples, i, j = [], 0, 0
    for e, n_ids, n_out, r_rows in zip(entries, lengths, outputs, route_rows, strict=True):
        samples.append(
            TrainSample(
                sample_id=_field(e, "sample_id", str, "sample"),
                input_ids=arrays["input_ids"][i : i + n_ids],
                num_prompt_tokens=_field(e, "num_prompt_tokens", int, "sample"),
                behav_logprobs=arrays["behav"][j : j + n_out],
                versions=arrays["versions"][j : j + n_out],
                advantage=float(_field(e, "advantage", (int, float), "sample")),
                reward=float(_field(e, "reward", (int, float), "sample")),
                loss_mask=arrays["mask"][j : j + n_out] if _field(e, "has_mask", int, "sample") else None,
                routes=next(routes) if r_rows >= 0 else None,
            )
        )
        i, j = i + n_ids, j + n_out
    return TrainBatch(
        version=_field(head, "version", int, "train batch"),
        samples=samples,
        group_ids=list(_field(head, "group_ids", list, "train batch")),
        filtered_group_ids=list(_field(head, "filtered_group_ids", list, "train batch")),
        max_new_tokens=_field(head, "max_new_tokens", int, "train batch"),
    )
