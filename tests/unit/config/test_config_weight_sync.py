"""rollout.dtype and weight_sync.sync: what the servers hold and when a delta is allowed."""

from __future__ import annotations

import pytest

from areal_jobs.config import DType, ServingDType, SyncMode, WeightSync, WeightSyncConfig, serving_dtype


@pytest.mark.parametrize(
    ("rollout", "model", "gpu", "expected"),
    [
        (ServingDType.auto, DType.float32, False, DType.float32),  # CPU: exact checks stay exact
        (ServingDType.auto, DType.float32, True, DType.bfloat16),  # GPUs serve bf16
        (ServingDType.auto, DType.bfloat16, True, DType.bfloat16),
        (ServingDType.auto, DType.float16, True, DType.float16),
        (ServingDType.bfloat16, DType.float32, False, DType.bfloat16),  # asked for: also on CPU
        (ServingDType.float32, DType.float32, True, DType.float32),
    ],
)
def test_serving_dtype(rollout, model, gpu, expected):
    assert serving_dtype(rollout, model, gpu) is expected


def test_weight_sync_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="weight_sync.full_every"):
        WeightSyncConfig(full_every=0)
    with pytest.raises(ValueError, match="weight_sync.method=distributed"):
        WeightSyncConfig(sync=SyncMode.delta, method=WeightSync.disk)
    assert WeightSyncConfig(sync=SyncMode.delta).full_every == 20
