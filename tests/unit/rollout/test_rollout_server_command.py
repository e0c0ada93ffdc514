"""The servers' command lines (issue 28): SGLang gets the job's API key from the environment, never
from its command line (`ps` showed `--api-key <token>` to every user of the node), and both engines
get the planner's share of a GPU they share, and the colocated schedule's memory release."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from areal_jobs.config import DType, RolloutConfig
from areal_jobs.rollout.server import sglang_command, sglang_env
from areal_jobs.rollout.sglang_launch import KEY_ENV, START_METHOD_ENV
from areal_jobs.rollout.vllm_server import vllm_command

REPO = Path(__file__).resolve().parents[3]
KEY = "k3y-" + "ab" * 16


def test_the_command_line_has_no_key_and_the_environment_does() -> None:
    rollout = RolloutConfig(extra_server_args=["--x"])
    for cpu in (True, False):
        cmd = sglang_command("/m", "127.0.0.1", 30000, rollout, DType.bfloat16, cpu, 0)
        assert cmd[1:3] == ["-m", "areal_jobs.rollout.sglang_launch"]
        assert "--api-key" not in cmd and not any(KEY in arg for arg in cmd)
    assert sglang_env(KEY, cpu=True, threads=1)[KEY_ENV] == KEY


def fake_launch_server(root: Path, source: str) -> None:
    """A stand-in `sglang.launch_server` module under `root` (put `root` first on PYTHONPATH)."""
    fake = root / "sglang"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(source)


def test_sglang_sees_the_key_and_ps_does_not(tmp_path: Path) -> None:
    """The real launcher module in front of a stand-in `sglang.launch_server`, which reports what
    SGLang would parse (sys.argv), what `ps` shows (/proc/self/cmdline), and its environment."""
    fake_launch_server(
        tmp_path,
        "import json, os, sys\n"
        "if __name__ == '__main__':\n"
        "    cmdline = open('/proc/self/cmdline', 'rb').read().decode().split('\\0')\n"
        f"    print(json.dumps({{'argv': sys.argv[1:], 'cmdline': cmdline, 'env': os.environ.get('{KEY_ENV}')}}))\n",
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]), **{KEY_ENV: KEY})
    cmd = sglang_command("/m", "127.0.0.1", 30000, RolloutConfig(), DType.float32, True, 0)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=True)
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["argv"][-2:] == ["--api-key", KEY] and "--model-path" in seen["argv"]
    assert not any(KEY in arg for arg in seen["cmdline"]) and "--model-path" in seen["cmdline"]
    assert seen["env"] is None  # taken out of the environment SGLang's children inherit


def test_without_a_key_the_launcher_refuses_to_start_an_open_server() -> None:
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "areal_jobs.rollout.sglang_launch", "--model-path", "/m"],
        env=dict(env, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1 and f"{KEY_ENV} is empty" in proc.stderr


def test_on_cpu_sglang_forks_its_children_and_its_own_spawn_request_is_ignored(
    tmp_path: Path, monkeypatch
) -> None:
    """rollout.sglang_cpu_fork: the launcher pins "fork" before SGLang runs, and SGLang's own
    `mp.set_start_method("spawn", force=True)` (its engine) no longer replaces it; a GPU server, or
    the knob off, leaves SGLang's spawn alone, whatever the caller's environment says."""
    assert sglang_env(KEY, cpu=True, threads=1, fork=True)[START_METHOD_ENV] == "fork"
    monkeypatch.setenv(START_METHOD_ENV, "fork")  # the caller's environment does not decide
    assert START_METHOD_ENV not in sglang_env(KEY, cpu=True, threads=1, fork=False)
    assert START_METHOD_ENV not in sglang_env(KEY, cpu=False, threads=1, fork=True)
    monkeypatch.delenv(START_METHOD_ENV)
    fake_launch_server(
        tmp_path,
        "import multiprocessing as mp\n"
        "if __name__ == '__main__':\n"
        "    mp.set_start_method('spawn', force=True)  # as SGLang's engine does\n"
        "    print(mp.get_start_method())\n",
    )
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]), **{KEY_ENV: KEY})
    cmd = sglang_command("/m", "127.0.0.1", 30000, RolloutConfig(), DType.float32, True, 0)
    for extra, method in (({START_METHOD_ENV: "fork"}, "fork"), ({}, "spawn")):
        proc = subprocess.run(
            cmd, env=dict(base, **extra), capture_output=True, text=True, timeout=60, check=True
        )
        assert proc.stdout.strip().splitlines()[-1] == method


def test_a_shared_gpu_gives_each_engine_its_share_and_the_colocated_release() -> None:
    shared = RolloutConfig(gpu_memory_fraction=0.45, release_memory_while_training=True)
    sglang = sglang_command("/m", "h", 1, shared, DType.bfloat16, False, 0)
    assert sglang[sglang.index("--mem-fraction-static") + 1] == "0.45" and "--enable-memory-saver" in sglang
    vllm = vllm_command("/p", "/m", "h", 1, shared, DType.bfloat16, False, 0)
    assert vllm[vllm.index("--gpu-memory-utilization") + 1] == "0.45" and "--enable-sleep-mode" in vllm
    for cpu, rollout in ((False, RolloutConfig()), (True, shared)):  # GPU to itself; CPU: no GPU memory
        for cmd in (
            sglang_command("/m", "h", 1, rollout, DType.float32, cpu, 0),
            vllm_command("/p", "/m", "h", 1, rollout, DType.float32, cpu, 0),
        ):
            flags = {
                "--mem-fraction-static",
                "--enable-memory-saver",
                "--gpu-memory-utilization",
                "--enable-sleep-mode",
            }
            assert not flags & set(cmd)
