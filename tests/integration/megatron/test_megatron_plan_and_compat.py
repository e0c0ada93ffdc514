"""Single-process checks of the Megatron backend's pieces: micro-batch planning over DP ranks and
where the CPU compatibility layer may (not) be switched on."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize("budget", [40, 64, 1000])
def test_plan_covers_every_sample_once_with_equal_counts(dp, budget):
    from areal_jobs.trainer.megatron.backend import plan_microbatches

    lengths = [18, 10, 11, 12, 9, 13, 7, 7, 30, 25, 3]
    plan = plan_microbatches(lengths, dp, budget)
    assert len(plan) == dp
    assert len({len(rank) for rank in plan}) == 1  # Megatron's schedules need one count on all ranks
    flat = sorted(i for rank in plan for mb in rank for i in mb)
    assert flat == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in mb) <= budget for rank in plan for mb in rank)
    loads = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    assert max(loads) - min(loads) <= max(lengths)  # shares balanced by tokens


def test_plan_pads_ranks_that_have_fewer_samples():
    from areal_jobs.trainer.megatron.backend import plan_microbatches

    plan = plan_microbatches([30, 30, 30], 4, 64)
    assert [len(rank) for rank in plan] == [1, 1, 1, 1]
    assert sorted(len(rank[0]) for rank in plan) == [0, 1, 1, 1]
    assert plan_microbatches([], 2, 64) == [[[]], [[]]]


def test_backend_modules_do_not_import_the_cpu_compat_layer():
    code = (
        "import sys; import areal_jobs.trainer.megatron.backend, areal_jobs.trainer.megatron.model; "
        "assert 'areal_jobs.trainer.megatron.cpu_compat' not in sys.modules, 'imported at import time'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_cpu_compat_refuses_a_machine_with_cuda(monkeypatch):
    import torch

    from areal_jobs.trainer.megatron import cpu_compat as megatron_cpu_compat

    assert not megatron_cpu_compat.is_enabled()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA"):
        megatron_cpu_compat.enable()
    assert not megatron_cpu_compat.is_enabled()
