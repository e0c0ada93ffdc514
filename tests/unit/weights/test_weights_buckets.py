"""Bucketing named tensors for flattened broadcasts."""

import pytest

from areal_jobs.api import TensorSpec
from areal_jobs.weights.buckets import bucket_bytes, plan_buckets, tensor_bytes


def test_buckets_respect_the_limit_and_keep_order():
    specs = [TensorSpec(f"w{i}", "float32", (10, 10)) for i in range(10)]  # 400 bytes each
    buckets = plan_buckets(specs, 1000)
    assert [len(b.tensors) for b in buckets] == [2, 2, 2, 2, 2]
    assert [t.name for b in buckets for t in b.tensors] == [s.name for s in specs]
    assert all(bucket_bytes(b) <= 1000 for b in buckets)
    assert [b.index for b in buckets] == list(range(5))


def test_one_dtype_per_bucket_and_oversized_tensor_alone():
    specs = [
        TensorSpec("a", "float32", (4,)),
        TensorSpec("b", "bfloat16", (4,)),
        TensorSpec("big", "float32", (1000,)),
        TensorSpec("c", "float32", (4,)),
    ]
    buckets = plan_buckets(specs, 100)
    assert all(len({t.dtype for t in b.tensors}) == 1 for b in buckets)
    assert any([t.name for t in b.tensors] == ["big"] for b in buckets)
    assert sorted(t.name for b in buckets for t in b.tensors) == ["a", "b", "big", "c"]


def test_sizes_and_errors():
    assert tensor_bytes(TensorSpec("x", "bfloat16", (3, 5))) == 30
    with pytest.raises(ValueError, match="unsupported dtype"):
        tensor_bytes(TensorSpec("x", "complex64", (1,)))
    with pytest.raises(ValueError):
        plan_buckets([], 0)
