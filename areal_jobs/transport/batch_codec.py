"""The trainer's TrainBatch as bytes, for rank 0 -> the other Megatron ranks (no pickle).

Same conventions as codec.py (JSON header, raw little-endian arrays, every length checked):
  8 bytes  header length H, uint64 little-endian
  H bytes  JSON: schema, kind, batch fields, one entry per sample (ids, lengths, scalars)
  then     input ids int64 [sum L_i] | behaviour log-probs float32 [sum n_i] |
           versions int32 [sum n_i] | loss masks uint8 [sum n_i] (1 where the sample has none)
No job token: the bytes travel only inside the trainer's own process group (torch.distributed),
which only this job's ranks joined; the schema version still guards mismatched code.
"""

from __future__ import annotations

import json

import numpy as np

from areal_jobs.api import TrainBatch, TrainSample
from areal_jobs.transport import messages as m
from areal_jobs.transport.codec import MessageError, _array, _field, _parse_json

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
            }
            for s in samples
        ],
    }
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
    if offset != len(data):
        raise MessageError(f"train batch: {len(data) - offset} trailing bytes")
    samples, i, j = [], 0, 0
    for e, n_ids, n_out in zip(entries, lengths, outputs, strict=True):
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
