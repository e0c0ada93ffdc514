"""The rollout side of the memory plan (launch/planning/fit/kv_cache.py): SGLang's default static
memory share, KV bytes per token, the clipped mean answer length, and the concurrency verdict."""

from __future__ import annotations

import numpy as np
import pytest

from areal_jobs.config import (
    ClusterConfig,
    DataConfig,
    DType,
    JobConfig,
    ModelConfig,
    RolloutConfig,
    RolloutEngine,
)
from launch.planning.fit.kv_cache import (
    VLLM_GPU_MEMORY_UTILIZATION,
    VLLM_MAX_NUM_SEQS,
    VLLM_OVERHEAD_BYTES,
    kv_cache_plan,
    mean_answer_tokens,
    mean_clipped_lognormal,
    sglang_default_mem_fraction,
)
from launch.planning.fit.model_shape import named_shape
from launch.planning.sim.profile import load_profile

GIB = 1 << 30


def test_sglang_default_fraction_on_an_80_gib_gpu() -> None:
    # reserved MiB = 512 + 1.5 x 8192 (chunked prefill) + 1024 x 1 / 8 (TP) + 2 x 256 (decode
    # graph batch) + 8 x 58 (prefill graph sizes up to 8192) = 13,904 -> (81,920 - 13,904) / 81,920
    assert sglang_default_mem_fraction(80, 1) == 0.830
    # TP 4: decode graphs up to 512 and 512 MiB of TP slack: 14,800 MiB reserved
    assert sglang_default_mem_fraction(80, 4) == round((81920 - 14800) / 81920, 3)
    # a 24 GiB card: chunked prefill 4096, graph batch 48, 50 prefill graph sizes, no 10 GiB floor:
    # 512 + 6,144 + 128 + 96 + 400 = 7,280 MiB of 24,576
    assert sglang_default_mem_fraction(24, 1) == round((24576 - 7280) / 24576, 3) == 0.704


def test_kv_bytes_per_token_splits_and_replicates_kv_heads() -> None:
    shape = named_shape("qwen2_1p5b")  # 28 layers, 2 KV heads of 128
    assert shape.kv_bytes_per_token(2) == 2 * 28 * 2 * 128 * 2 == 28672
    assert shape.kv_bytes_per_token(2, tp_size=2) == 28672 // 2
    assert shape.kv_bytes_per_token(2, tp_size=4) == 28672 // 2  # 2 heads over 4 GPUs: replicated


def test_mean_of_the_clipped_lognormal_matches_sampling() -> None:
    rng = np.random.default_rng(0)
    draws = np.exp(np.log(4000) + 0.78 * rng.standard_normal(400_000))
    expected = np.clip(draws, 16, 16384).mean()
    assert mean_clipped_lognormal(4000, 0.78, 16, 16384) == pytest.approx(expected, rel=0.01)
    assert mean_clipped_lognormal(4000, 0.0, 16, 2000) == 2000


def job(engine=RolloutEngine.sglang, *, tp=1, concurrent=16384, max_new=16384) -> JobConfig:
    return JobConfig(
        model=ModelConfig(path="/nowhere", shape="qwen2_1p5b", dtype=DType.bfloat16),
        data=DataConfig(max_prompt_tokens=512),
        rollout=RolloutConfig(engine=engine, tp_size=tp, max_concurrent=concurrent, max_new_tokens=max_new),
        cluster=ClusterConfig(nodes=64, gpu_memory_gib=80),
    )


def test_the_flagship_servers_hold_their_requests_by_hand() -> None:
    plan = kv_cache_plan(job(), named_shape("qwen2_1p5b"), num_servers=384)
    weights = 1_777_088_000 * 2
    assert plan.weights_bytes_per_gpu == weights
    assert plan.kv_bytes_per_gpu == int(0.830 * 80 * GIB) - weights
    assert plan.capacity_tokens == (int(0.830 * 80 * GIB) - weights) // 28672
    assert plan.concurrency == 43  # 16,384 requests over 384 servers, rounded up
    lengths = load_profile("paper_1p5b").lengths
    assert plan.mean_tokens == pytest.approx(512 + mean_answer_tokens(lengths, 16384))
    assert plan.longest_tokens == 512 + 16384
    assert plan.fits and plan.holds_at_mean >= 43
    assert "holds them" in plan.describe()


def test_too_many_requests_per_server_are_reported_with_what_it_holds() -> None:
    plan = kv_cache_plan(job(concurrent=16384 * 16), named_shape("qwen2_1p5b"), num_servers=384)
    assert not plan.fits
    assert plan.holds_at_mean == int(plan.capacity_tokens // plan.mean_tokens)
    text = plan.describe()
    assert f"holds only {plan.holds_at_mean} of the {plan.concurrency} requests" in text
    assert "lower rollout.max_concurrent" in text


def test_vllm_gets_its_utilisation_less_weights_and_overhead_and_its_sequence_cap() -> None:
    plan = kv_cache_plan(job(RolloutEngine.vllm, tp=2), named_shape("qwen2_7b"), num_servers=8)
    weights = named_shape("qwen2_7b").num_params() * 2 // 2
    assert plan.static_fraction == VLLM_GPU_MEMORY_UTILIZATION
    assert (
        plan.kv_bytes_per_gpu == int(VLLM_GPU_MEMORY_UTILIZATION * 80 * GIB) - weights - VLLM_OVERHEAD_BYTES
    )
    assert plan.max_requests == VLLM_MAX_NUM_SEQS
    assert plan.concurrency == 2048 and not plan.fits and plan.holds_at_mean <= VLLM_MAX_NUM_SEQS


def test_a_given_static_share_replaces_the_default() -> None:
    plan = kv_cache_plan(job(), named_shape("qwen2_1p5b"), num_servers=8, static_fraction=0.3)
    assert plan.static_fraction == 0.3
    assert plan.kv_bytes_per_gpu == int(0.3 * 80 * GIB) - 1_777_088_000 * 2
