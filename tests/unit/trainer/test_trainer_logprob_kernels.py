"""The fused Triton log-prob head (trainer/forward/logprob_kernels.py, `trainer.logprob_kernel=triton`).

The kernels run on CPU through Triton's interpreter, which TRITON_INTERPRET=1 selects when Triton
is imported: logprob_kernel_cases.py runs every case in one process of its own with it set (~15 s
on 2 cores, a real 2-rank gloo group included), so this process and the rest of the suite keep
compiled Triton. Against:
  - plain float64 autograd, the kernels in float64: the closed forms, to 1e-12;
  - the float64 truth, the kernels in float32: values within 4 float32 ulps, gradients within
    16 ulps of their largest entry (float32 sums over up to 50 terms), at temperatures 1, 0.7, 1.3,
    with and without the entropy's gradient;
  - today's chunked torch path in float32, at the tolerances its own tests use against full-vocabulary
    autograd (1e-6 absolute and relative); in bf16 (the GPU's dtype), values within 4 float32 ulps
    (the same bf16 logits) and gradients within 4 bf16 ulps of their largest entry (the gradient
    is cast to bf16 before the matmuls: a rounding step may fall either side);
  - a padded vocabulary (no gradient on the padding), two TP shards emulated in threads (the
    combined statistics, each shard's dlogits exactly its columns, and a swapped shard detected),
    and two real gloo ranks each holding half of a padded vocabulary.
Every case also fails on a positive log-prob, a non-finite value or an entropy outside [0, log V].
In this process: the kernels compile for Hopper (sm_90) without a GPU, the CPU refusal without the
interpreter, and the auto choice.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_jobs.config import LogprobKernel, TrainerConfig
from areal_jobs.trainer.forward.logprobs import head_logprobs, resolve_kernel

REPO = Path(__file__).resolve().parents[3]
CASES = Path(__file__).with_name("logprob_kernel_cases.py")
EPS32 = torch.finfo(torch.float32).eps
EPS_BF16 = torch.finfo(torch.bfloat16).eps
LOG_V = math.log(50)  # the cases' vocabulary


@pytest.fixture(scope="module")
def cases() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(CASES)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def check_sane(case: dict, prefix: str = "") -> None:
    assert case[f"{prefix}all_finite"], "a non-finite log-prob, entropy or gradient"
    assert case[f"{prefix}max_logp"] <= 0.0, f"a positive log-prob: {case[f'{prefix}max_logp']}"
    assert 0.0 <= case[f"{prefix}min_entropy"], case
    assert case[f"{prefix}max_entropy"] <= LOG_V * (1 + 4 * EPS32), case


def within(case: dict, name: str, values_ulps: float, grads_eps: float, eps: float = EPS32) -> None:
    """Values within `values_ulps` float32 ulps of max(1, scale); gradients within grads_eps x eps
    of their largest entry."""
    for out in ("logp", "entropy"):
        bound = values_ulps * EPS32 * max(1.0, case[f"{name}{out}_scale"])
        assert case[f"{name}{out}_err"] <= bound, (out, case[f"{name}{out}_err"], bound)
    for out in ("d_hidden", "d_weight"):
        bound = grads_eps * eps * case[f"{name}{out}_scale"]
        assert case[f"{name}{out}_err"] <= bound, (out, case[f"{name}{out}_err"], bound)


@pytest.mark.parametrize("name", ["float64_exact_t0.7_entropy", "float64_exact_t1"])
def test_float64_kernels_equal_autograd(cases, name):
    case = cases[name]
    check_sane(case)
    for out in ("logp", "entropy", "d_hidden", "d_weight"):
        assert case[f"{out}_err"] <= 1e-12 * max(1.0, case[f"{out}_scale"]), (out, case)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("grad", ["logp", "entropy"])
def test_float32_kernels_against_float64_and_the_torch_path(cases, temperature, grad):
    case = cases[f"float32_t{temperature}_{grad}"]
    check_sane(case)
    within(case, "truth_", values_ulps=4, grads_eps=16)
    for out in ("logp", "entropy", "d_hidden", "d_weight"):
        err, scale = case[f"torch_{out}_err"], case[f"torch_{out}_scale"]
        assert err <= 1e-6 + 1e-6 * scale, (out, err, scale)


def test_bfloat16_kernels_against_the_torch_path(cases):
    case = cases["bfloat16"]
    check_sane(case)
    within(case, "", values_ulps=4, grads_eps=4, eps=EPS_BF16)


def test_padded_vocabulary_rows_are_left_out(cases):
    case = cases["padded_vocabulary"]
    check_sane(case)
    assert case["padding_grad"] == 0.0
    for out in ("logp", "entropy", "d_hidden", "d_weight"):
        assert case[f"{out}_err"] <= 1e-6 + 1e-6 * case[f"{out}_scale"], (out, case)


def test_two_emulated_shards_combine_to_the_one_shard_values(cases):
    case = cases["tp2_emulated"]
    check_sane(case)
    for rank in (0, 1):
        for out in ("logp", "entropy", "lse"):
            # values of order 10: 4 float32 ulps of 10
            assert case[f"rank{rank}_{out}_err"] <= 4 * EPS32 * 10, (rank, out, case)
    assert case["dlogits_shard_err"] <= EPS32 * case["dlogits_scale"], case
    # the check has teeth: shards that read each other's vocabulary offsets are far off
    assert case["swapped_logp_err"] > 0.1, case


def test_two_gloo_ranks_match_one_float64_process(cases):
    case = cases["tp2_gloo"]
    for rank in (0, 1):
        prefix = f"rank{rank}_"
        check_sane(case, prefix)
        assert case[f"{prefix}padding_grad"] == 0.0
        within(case, prefix, values_ulps=4, grads_eps=16)


def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter accepts what the compiler may not: compile both kernels (bf16 and float32
    logits, with and without the entropy term) to sm_90 machine code, as on an H100/H200."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from areal_jobs.trainer.forward import logprob_kernels as k

    target = GPUTarget("cuda", 90, 32)
    for dtype in ("bf16", "fp32"):
        common = {"Z": f"*{dtype}", "stride_z": "i64", "TGT": "*i64", "n_cols": "i32", "temperature": "fp32"}
        stats = ASTSource(
            triton.jit(k.head_stats_kernel),
            signature={**common, "OUT": "*fp32", "BLOCK_V": "constexpr", "F64": "constexpr"},
            constexprs={"BLOCK_V": k.GPU_BLOCK_V, "F64": False},
        )
        assert triton.compile(stats, target=target, options={"num_warps": k.GPU_NUM_WARPS}).asm["cubin"]
        for has_gh in (True, False):
            sig = {**common, **{p: "*fp32" for p in ("LSE", "ENT", "GL", "GH")}}
            sig.update(HAS_GH="constexpr", BLOCK_V="constexpr", F64="constexpr")
            grads = ASTSource(
                triton.jit(k.head_dlogits_kernel),
                signature=sig,
                constexprs={"HAS_GH": has_gh, "BLOCK_V": k.GPU_BLOCK_V, "F64": False},
            )
            assert triton.compile(grads, target=target, options={"num_warps": k.GPU_NUM_WARPS}).asm["cubin"]


def test_cpu_without_the_interpreter_is_refused_by_name():
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(RuntimeError, match="trainer.logprob_kernel=torch"):
        head_logprobs(hidden, weight, torch.zeros(4, dtype=torch.long), kernel="triton")


def test_auto_is_triton_on_cuda_and_torch_on_cpu(monkeypatch):
    assert resolve_kernel(LogprobKernel.auto, None) == "torch"
    assert resolve_kernel(LogprobKernel.auto, torch.device("cpu")) == "torch"
    assert resolve_kernel(LogprobKernel.auto, torch.device("cuda", 0)) == "triton"
    assert resolve_kernel(LogprobKernel.torch, torch.device("cuda", 0)) == "torch"
    monkeypatch.setattr("areal_jobs.trainer.forward.logprob_kernels.triton_available", lambda: False)
    assert resolve_kernel(LogprobKernel.auto, torch.device("cuda", 0)) == "torch"
    with pytest.raises(ValueError, match="trainer.logprob_kernel=torch"):
        resolve_kernel(LogprobKernel.triton, torch.device("cuda", 0))


def test_config_refuses_the_kernel_without_chunks():
    with pytest.raises(ValueError, match="trainer.logprob_chunk_tokens"):
        TrainerConfig(logprob_kernel=LogprobKernel.triton, logprob_chunk_tokens=0)
    assert TrainerConfig().logprob_kernel is LogprobKernel.auto
