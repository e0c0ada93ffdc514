"""The sender's side of an encoded update (weight_sync.sync=delta): the last shipped copy, and one
bucket through the delta protocol (areal_jobs/weights/receiver.py is the other side).

The copy holds what every server was last sent, in the serving dtype, on the host (pinned on GPU
nodes, so the device-to-host copy of the next version runs at full speed). It is valid only from
the end of a completed send until the next one starts: a send that breaks off leaves it at
version -1, and the next update is a full copy.
"""

from __future__ import annotations

import logging
import time

import torch

from areal_jobs.api import BucketSpec
from areal_jobs.weights import delta as codec
from areal_jobs.weights.broadcast import WeightBroadcastGroup
from areal_jobs.weights.phases import UpdatePhases
from areal_jobs.weights.receiver import REFUSED, STATUS_FIELDS

logger = logging.getLogger(__name__)


class SenderCopy:
    """The tensors of the last completed update, by name (host memory), and their version."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.version = -1  # -1: nothing every server is known to hold (start, or a broken send)
        self.tensors: dict[str, torch.Tensor] = {}
        self._staging: dict[str, torch.Tensor] = {}

    def host(self, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`tensor` rounded to the serving dtype, on the host. On GPU nodes through a pinned buffer
        reused every update; on CPU the cast itself (no copy when the dtype is already right)."""
        cast = tensor.detach().to(dtype)
        if not cast.is_cuda:
            return cast.contiguous()
        buf = self._staging.get(name)
        if buf is None or buf.shape != cast.shape or buf.dtype != dtype:
            buf = torch.empty(cast.shape, dtype=dtype, pin_memory=self.pin)
            self._staging[name] = buf
        buf.copy_(cast)
        return buf

    def base(self, names: list[str]) -> list[torch.Tensor]:
        return [self.tensors[n] for n in names]

    def keep(self, names: list[str], new: list[torch.Tensor]) -> None:
        """This bucket's new values become the copy (before the bucket is sent: see `version`)."""
        for name, tensor in zip(names, new, strict=True):
            held = self.tensors.get(name)
            if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
                held = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin)
                self.tensors[name] = held
            held.copy_(tensor)


def send_encoded_bucket(
    group: WeightBroadcastGroup,
    bucket: BucketSpec,
    new: list[torch.Tensor],
    base: list[torch.Tensor] | None,
    base_version: int,
    version: int,
    stage: str,
    phases: UpdatePhases,
) -> None:
    """Encode one bucket against `base` (None: a full copy), send it, collect every receiver's
    status, and answer a refusal with the whole bucket. Bytes and seconds go into `phases`."""
    t0 = time.perf_counter()
    header, payload, entries = codec.encode_bucket(base, new, base_version, version)
    t_encoded = time.perf_counter()
    raw_header = header.to_tensor()
    group.broadcast(raw_header, f"{stage}: header")
    if payload.numel():
        group.broadcast(payload, stage)
    rows = [
        r.tolist()
        for r in group.all_gather(torch.zeros(STATUS_FIELDS, dtype=torch.int64), f"{stage}: status")
    ]
    sent = raw_header.numel() * 8 + payload.numel()
    refused = [rank for rank, row in enumerate(rows) if row[0] == REFUSED]
    if refused:
        _, whole, _ = codec.encode_bucket(None, new, -1, version)
        group.broadcast(whole, f"{stage}: whole bucket after a refusal")
        sent += whole.numel()
        phases.refused_buckets += 1
        logger.warning(
            "%s: group ranks %s refused the delta (%s); they took the whole bucket",
            stage, refused, ", ".join(sorted({codec.REASONS.get(rows[r][1], "?") for r in refused})),
        )  # fmt: skip
    t_end = time.perf_counter()
    phases.stage_s += t_encoded - t0
    phases.add_bucket_send(t_end - t_encoded)
    phases.add_server_rows(rows)
    phases.bytes_per_server += sent
    phases.full_bytes += sum(codec.pad8(t.numel() * t.element_size()) for t in new)
    phases.elements += sum(t.numel() for t in new)
    if base is not None:  # a full copy's entries say nothing about what changed (StageSender measures it)
        phases.changed += codec.changed_elements(entries)
    phases.sparse_tensors += sum(e.kind == codec.SPARSE for e in entries)
    phases.dense_tensors += sum(e.kind == codec.DENSE for e in entries)
    phases.same_tensors += sum(e.kind == codec.SAME for e in entries)
