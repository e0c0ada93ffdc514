"""Rollout side of the memory plan: how many tokens a server's KV cache holds, and whether that
covers the requests the recipe keeps in flight. Pure: no torch, no engine import.

A server of `rollout.tp_size` GPUs keeps its weights (split over TP) and a KV pool in the memory
its engine reserves statically:
  SGLang  `--mem-fraction-static` (weights + KV pool) / GPU memory; its default (SGLang 0.5.x,
          server_args' memory hook) is (GPU - reserved) / GPU with reserved (MiB) = 512 +
          1.5 x max(chunked_prefill_size, 2048) + 1024 x TP x PP / 8 + 2 x decode CUDA-graph max
          batch + 8 x prefill CUDA-graph sizes, at least 10 GiB above 60 GiB of GPU memory
          (chunked prefill 8192 and graph batch 256 on an 80 GiB GPU: 0.830). The pool is then
          what is left of that share once the weights are loaded.
  vLLM    `--gpu-memory-utilization` (0.92 in vLLM 0.32, 0.9 before) of the GPU for everything;
          the KV cache gets it minus the weights and the profiled activation peak and CUDA graphs
          (VLLM_OVERHEAD_BYTES, an estimate); at most `max_num_seqs` (1024 on H100-class GPUs)
          requests run at once.
KV bytes per token per GPU: 2 (K, V) x layers x max(1, KV heads / TP) x head_dim x dtype bytes.

Demand: `rollout.max_concurrent` requests spread over the servers, each holding its prompt and its
answer so far (prompt + answer at its end). The check counts every request at its full mean length,
prompt + mean answer from the allocation profile's length model (`cluster.allocation_profile`,
answers clipped at rollout.max_new_tokens): a server must hold concurrency x that many tokens, or it
runs fewer requests than the plan assumes and throughput drops (SGLang queues or retracts the rest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from areal_jobs.config import DType, JobConfig, RolloutEngine, serving_dtype
from launch.planning.fit.model_shape import ModelShape
from launch.planning.sim.profile import LengthModel, load_profile

GIB = 1 << 30
MIB = 1 << 20
VLLM_GPU_MEMORY_UTILIZATION = 0.92  # vLLM 0.32's default (vllm/config/cache.py)
VLLM_MAX_NUM_SEQS = 1024  # vLLM's default max_num_seqs for the API server on >= 70 GiB GPUs
VLLM_OVERHEAD_BYTES = 3 * GIB  # profiled activation peak (8192 batched tokens), sampler, CUDA graphs
_BYTES = {DType.float32: 4, DType.bfloat16: 2, DType.float16: 2}


def sglang_default_mem_fraction(gpu_memory_gib: float, tp_size: int, pp_size: int = 1) -> float:
    """SGLang's default `--mem-fraction-static` for a GPU of this size (its memory hook's rule)."""
    gpu_mib = gpu_memory_gib * 1024
    if gpu_mib < 20 * 1024:
        chunked, graph_bs = 2048, 8
    elif gpu_mib < 35 * 1024:
        chunked, graph_bs = 4096, 48 if tp_size < 4 else 160
    elif gpu_mib < 60 * 1024:
        chunked, graph_bs = 4096, 32 if tp_size < 4 else 160
    elif gpu_mib < 160 * 1024:
        chunked, graph_bs = 8192, 256 if tp_size < 4 else 512
    else:
        chunked, graph_bs = 16384, 512
    prefill_graphs = len(_prefill_graph_sizes(chunked))
    reserved = (
        512 + 1.5 * max(chunked, 2048) + tp_size * pp_size / 8 * 1024 + 2 * graph_bs + 8 * prefill_graphs
    )
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mib - reserved) / gpu_mib, 3)


def _prefill_graph_sizes(max_tokens: int) -> list[int]:
    sizes = [
        *range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
        *range(1280, 4097, 256), *range(4608, max_tokens + 1, 512),
    ]  # fmt: skip
    return [s for s in sizes if s <= max_tokens]


def mean_clipped_lognormal(median: float, sigma: float, low: float, high: float) -> float:
    """E[clip(X, low, high)] for X lognormal with this median and log-sd."""
    if sigma <= 0:
        return min(max(median, low), high)
    mu = math.log(median)

    def cdf(z: float) -> float:
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    a, b = (math.log(low) - mu) / sigma, (math.log(high) - mu) / sigma
    inside = math.exp(mu + sigma**2 / 2) * (cdf(b - sigma) - cdf(a - sigma))
    return low * cdf(a) + inside + high * (1 - cdf(b))


def mean_answer_tokens(lengths: LengthModel, max_new_tokens: int) -> float:
    sigma = math.hypot(lengths.prompt_sigma, lengths.sample_sigma)
    high = min(lengths.max_tokens, max_new_tokens)
    return mean_clipped_lognormal(lengths.median_tokens, sigma, min(lengths.min_tokens, high), high)


@dataclass(frozen=True)
class KvCachePlan:
    """One rollout server's KV cache against the requests the recipe keeps in flight on it."""

    engine: RolloutEngine
    tp_size: int
    static_fraction: float  # SGLang mem_fraction_static / vLLM gpu_memory_utilization
    weights_bytes_per_gpu: int
    kv_bytes_per_gpu: int
    kv_bytes_per_token: int  # per GPU
    concurrency: int  # requests in flight per server (rollout.max_concurrent / servers)
    mean_tokens: float  # prompt + mean answer
    longest_tokens: int  # prompt + rollout.max_new_tokens
    max_requests: int  # the engine's own cap on running requests

    @property
    def capacity_tokens(self) -> int:
        return max(0, self.kv_bytes_per_gpu // self.kv_bytes_per_token)

    @property
    def needed_tokens(self) -> int:
        return math.ceil(self.concurrency * self.mean_tokens)

    @property
    def holds_at_mean(self) -> int:
        return min(self.max_requests, int(self.capacity_tokens // self.mean_tokens))

    @property
    def holds_at_longest(self) -> int:
        return min(self.max_requests, self.capacity_tokens // self.longest_tokens)

    @property
    def fits(self) -> bool:
        return self.holds_at_mean >= self.concurrency

    def describe(self) -> str:
        knob = "mem_fraction_static" if self.engine is RolloutEngine.sglang else "gpu_memory_utilization"
        head = (
            f"rollout KV cache per server ({self.engine.value}, TP {self.tp_size}, {knob} "
            f"{self.static_fraction:.3f}): {self.kv_bytes_per_gpu / GIB:.1f} GiB per GPU after "
            f"{self.weights_bytes_per_gpu / GIB:.1f} GiB of weights = {self.capacity_tokens:,} tokens "
            f"({self.kv_bytes_per_token / 1024:.0f} KiB each)"
        )
        demand = (
            f"  in flight: {self.concurrency} requests x {self.mean_tokens:,.0f} tokens (prompt + mean "
            f"answer) = {self.needed_tokens:,} tokens"
        )
        if self.fits:
            verdict = (
                f"  holds them: {self.holds_at_mean} requests at the mean length, "
                f"{self.holds_at_longest} at the longest ({self.longest_tokens:,} tokens)"
            )
        else:
            verdict = (
                f"  WARNING: it holds only {self.holds_at_mean} of the {self.concurrency} requests at the "
                f"mean length ({self.holds_at_longest} at the longest): the rest wait, and the plan's "
                "throughput assumes they run; lower rollout.max_concurrent, raise rollout.tp_size, or "
                "add rollout servers"
            )
        return "\n".join([head, demand, verdict])


def kv_cache_plan(
    job: JobConfig, shape: ModelShape, num_servers: int, *, static_fraction: float | None = None
) -> KvCachePlan:
    """The KV cache of one server of this job on `cluster.gpu_memory_gib` GPUs. `static_fraction`
    overrides the engine's default share (a colocated or shared GPU gets less)."""
    # planned servers run on GPUs: they hold rollout.dtype (auto: bf16), whatever the trainer's masters
    rollout, dtype_bytes = job.rollout, _BYTES[serving_dtype(job.rollout.dtype, job.model.dtype, gpu=True)]
    tp, gpu = rollout.tp_size, job.cluster.gpu_memory_gib * GIB
    weights = shape.num_params() * dtype_bytes // tp
    if rollout.engine is RolloutEngine.sglang:
        fraction = static_fraction or sglang_default_mem_fraction(job.cluster.gpu_memory_gib, tp)
        kv = int(fraction * gpu) - weights
        cap = 4096  # SGLang's request slots: at most 4096 unless max_running_requests says more
    else:
        fraction = static_fraction or VLLM_GPU_MEMORY_UTILIZATION
        kv = int(fraction * gpu) - weights - VLLM_OVERHEAD_BYTES
        cap = VLLM_MAX_NUM_SEQS
    lengths = load_profile(job.cluster.allocation_profile).lengths
    prompt = min(lengths.prompt_tokens, job.data.max_prompt_tokens)
    return KvCachePlan(
        engine=rollout.engine,
        tp_size=tp,
        static_fraction=fraction,
        weights_bytes_per_gpu=weights,
        kv_bytes_per_gpu=max(0, kv),
        kv_bytes_per_token=shape.kv_bytes_per_token(dtype_bytes, tp),
        concurrency=math.ceil(rollout.max_concurrent / max(1, num_servers)),
        mean_tokens=prompt + mean_answer_tokens(lengths, rollout.max_new_tokens),
        longest_tokens=job.data.max_prompt_tokens + rollout.max_new_tokens,
        max_requests=cap,
    )
