"""A server rank's side of an encoded bucket (weight_sync.sync=delta): receive, apply onto its own
copy of the version the delta was cut from, verify, load into the engine, report.

Runs inside the rollout engine's process (SGLang's scheduler through our custom weight loader,
rollout/sglang_delta.py; vLLM's worker through our worker extension, rollout/vllm_worker.py), so
it imports only the standard library, torch and the pure codec. Per bucket, over the sender's
broadcast group (rank 0 = the trainer's sender):

    broadcast  header (int64)             sender -> all
    broadcast  payload (uint8)            sender -> all, when it has any bytes
               apply onto the copy, verify the crc, undo on failure; load what changed
    all_gather status (int64 x STATUS)    everyone learns who refused and why
    broadcast  the bucket whole           only when someone refused: the refusers take it

The copy (`BaseCopy`) holds every tensor this rank received, in Hugging Face layout and the
serving dtype, on the host, with the version each tensor holds. A delta is applied only onto
tensors that hold its base version, with the same shape and dtype, and only kept when the crc
of the result is the sender's; otherwise it is refused (logged, undone) and the rank takes the
whole bucket that follows. The engine never sees a refused delta.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from areal_jobs.weights import delta as codec

logger = logging.getLogger("areal_jobs.weights.receiver")

# status row of every rank (the sender's is zeros): accepted, refusal reason, microseconds spent
# receiving, applying and loading
OK, REFUSED, FAILED = 0, 1, 2
STATUS_FIELDS = 5

Load = Callable[[list[tuple[str, torch.Tensor]]], None]


class BucketUnusable(RuntimeError):
    """Even the whole bucket failed its checksum: this rank cannot hold the weights."""


class BaseCopy:
    """This rank's copy of the last version it received, tensor by tensor (host memory)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.versions: dict[str, int] = {}

    def targets(
        self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], base_version: int
    ) -> list[torch.Tensor]:
        """The tensors a delta cut from `base_version` is applied onto, or DeltaRefused."""
        out = []
        for name, dtype, shape in specs:
            held = self.tensors.get(name)
            if held is None:
                raise codec.DeltaRefused(codec.NO_BASE, f"{name} was never received")
            if held.dtype != dtype or tuple(held.shape) != shape:
                raise codec.DeltaRefused(
                    codec.SHAPE,
                    f"{name} is {tuple(held.shape)} {held.dtype} here, {shape} {dtype} in the delta",
                )
            if self.versions[name] != base_version:
                raise codec.DeltaRefused(
                    codec.WRONG_BASE,
                    f"{name} holds version {self.versions[name]}, the delta's base is {base_version}",
                )
            out.append(held)
        return out

    def fresh(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
        """Tensors a full copy is written into (reused when the shape and dtype still match)."""
        out = []
        for name, dtype, shape in specs:
            held = self.tensors.get(name)
            if held is None or held.dtype != dtype or tuple(held.shape) != shape:
                held = torch.empty(shape, dtype=dtype)
                self.tensors[name] = held
            self.versions[name] = -1  # nothing valid until the crc says so
            out.append(held)
        return out

    def invalidate(self) -> None:
        """Nothing here is known to be any version (an update broke off mid-bucket)."""
        for name in self.versions:
            self.versions[name] = -1

    def mark(self, names: list[str], version: int) -> None:
        for name in names:
            self.versions[name] = version

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def receive_bucket(
    copy: BaseCopy,
    group: dist.ProcessGroup,
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    device: torch.device,
    load: Load,
    load_all: bool,
) -> dict[str, float]:
    """One encoded bucket from rank 0 of `group`. `load(named_tensors)` puts tensors into the
    engine; `load_all`: every tensor of the bucket (vLLM's layer-wise reload processes a layer only
    once all its tensors arrived), else only the changed ones (SGLang loads tensor by tensor).
    Raises only when even the whole bucket failed its crc (the engine then stops: a server that
    cannot hold the weights must leave the pool)."""
    names = [name for name, _, _ in specs]
    t0 = time.perf_counter()
    raw = torch.empty(codec.header_len(len(specs)), dtype=torch.int64, device=device)
    dist.broadcast(raw, group=group, group_src=0)
    try:
        header = codec.Header.from_tensor(raw.cpu(), len(specs))
    except ValueError as exc:  # nothing to size the payload by: the sender is not speaking this format
        raise RuntimeError(f"weight bucket {names[:3]}...: {exc}") from None
    payload = torch.empty(header.payload_bytes, dtype=torch.uint8, device=device)
    if header.payload_bytes:
        dist.broadcast(payload, group=group, group_src=0)
    payload = payload.cpu()
    t_recv = time.perf_counter()
    status, reason = OK, 0
    try:
        targets = copy.fresh(specs) if header.base_version < 0 else copy.targets(specs, header.base_version)
        touched = codec.apply_bucket(targets, header, payload)
        copy.mark(names, header.version)
    except codec.DeltaRefused as exc:
        status, reason = REFUSED, exc.reason
        logger.warning(
            "refused the update to version %d (base %d): %s", header.version, header.base_version, exc
        )
    t_apply = time.perf_counter()
    if status == OK:
        chosen = range(len(specs)) if load_all else touched
        load([(names[i], copy.tensors[names[i]]) for i in chosen])
    t_load = time.perf_counter()
    row = torch.tensor(
        [status, reason, _us(t_recv - t0), _us(t_apply - t_recv), _us(t_load - t_apply)],
        dtype=torch.int64, device=device,
    )  # fmt: skip
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    refused = any(int(r[0]) == REFUSED for r in rows)
    if refused:  # the sender answers with the whole bucket; only the refusers keep it
        whole = torch.empty(_dense_bytes(specs), dtype=torch.uint8, device=device)
        dist.broadcast(whole, group=group, group_src=0)
        if status == REFUSED:
            _take_whole(copy, specs, header, whole.cpu())
            load([(name, copy.tensors[name]) for name in names])
    return {
        "recv_s": t_recv - t0,
        "apply_s": t_apply - t_recv,
        "load_s": time.perf_counter() - t_apply if status == REFUSED else t_load - t_apply,
        "refused": float(status == REFUSED),
        "answered_whole": float(refused),
    }


def _take_whole(copy: BaseCopy, specs, header: codec.Header, whole: torch.Tensor) -> None:
    full = codec.Header(-1, header.version, header.crc, whole.numel(), (codec.DENSE,) * len(specs),
                        tuple(_numel(shape) for _, _, shape in specs))  # fmt: skip
    try:
        codec.apply_bucket(copy.fresh(specs), full, whole)
    except codec.DeltaRefused as exc:
        raise BucketUnusable(f"the whole bucket of version {header.version} failed too: {exc}") from None
    copy.mark([name for name, _, _ in specs], header.version)
    logger.info("took the whole bucket of version %d instead", header.version)


def _dense_bytes(specs) -> int:
    return sum(
        codec.pad8(_numel(shape) * torch.empty((), dtype=dtype).element_size()) for _, dtype, shape in specs
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _us(seconds: float) -> int:
    return int(seconds * 1e6)


def parse_specs(
    names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [
        (n, getattr(torch, d), tuple(int(x) for x in s))
        for n, d, s in zip(names, dtypes, shapes, strict=True)
    ]


def group_device(group: dist.ProcessGroup) -> torch.device:
    """NCCL groups move CUDA tensors only; gloo moves host tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
