"""Grouping named tensors into flattened broadcast buckets (pure).

A bucket is its tensors' raw bytes back to back, in order, which is the layout SGLang's
`load_format="flattened_bucket"` receives into. Buckets hold one dtype each so that every
tensor starts at an offset aligned to its element size. Order is preserved within a dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

from areal_jobs.api import BucketSpec, TensorSpec

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1}


def tensor_bytes(spec: TensorSpec) -> int:
    numel = 1
    for dim in spec.shape:
        numel *= dim
    try:
        return numel * DTYPE_BYTES[spec.dtype]
    except KeyError:
        raise ValueError(f"tensor {spec.name}: unsupported dtype {spec.dtype!r}") from None


def bucket_bytes(bucket: BucketSpec) -> int:
    return sum(tensor_bytes(t) for t in bucket.tensors)


def plan_buckets(specs: Sequence[TensorSpec], max_bytes: int) -> list[BucketSpec]:
    """Split into buckets of at most `max_bytes`; a tensor larger than that gets its own bucket."""
    if max_bytes < 1:
        raise ValueError("weight_sync.bucket_bytes must be >= 1")
    by_dtype: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        by_dtype.setdefault(spec.dtype, []).append(spec)
    groups: list[list[TensorSpec]] = []
    for dtype_specs in by_dtype.values():
        current: list[TensorSpec] = []
        used = 0
        for spec in dtype_specs:
            size = tensor_bytes(spec)
            if current and used + size > max_bytes:
                groups.append(current)
                current, used = [], 0
            current.append(spec)
            used += size
        if current:
            groups.append(current)
    return [BucketSpec(index=i, tensors=tuple(g)) for i, g in enumerate(groups)]
