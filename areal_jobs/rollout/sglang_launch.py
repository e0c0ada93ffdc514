"""`python -m sglang.launch_server`, with the API key taken from the environment, not the command line.

SGLang 0.5.23 reads its API key only from `--api-key` (or a `--config` YAML file); there is no
environment variable for it. On the command line, every user of the node reads it with `ps`
(/proc/<pid>/cmdline is world-readable). This module runs as the server's main program: it takes
the key from AREAL_SGLANG_API_KEY (the launcher sets it; /proc/<pid>/environ is readable by the
owner only), removes it from the environment SGLang's children inherit, appends `--api-key` to
sys.argv (Python's copy of the arguments: the kernel's copy, which `ps` shows, is unchanged) and
runs sglang.launch_server as __main__, exactly as `-m` would (spawned children re-import it by name).
Standard library only: it runs before SGLang is imported.

AREAL_SGLANG_START_METHOD=fork (server.py sets it on CPU, rollout.sglang_cpu_fork): SGLang starts
its scheduler and detokenizer processes with multiprocessing's "spawn", forced
(`mp.set_start_method("spawn", force=True)` in its engine), so each child imports torch,
transformers and SGLang again: 12 and 9 CPU seconds of the 31 a CPU server's start costs here.
Forked, they inherit the imported modules (start 28.7 s and 13.1 CPU s instead of 63.6 s and 31.3,
measured side by side on a loaded 2-core machine). The fork happens while the server's main
process has a single thread (no OpenMP pool, no tokenizer threads yet), so no lock or thread state
is copied half-way. Never on a GPU: CUDA cannot be used in a forked child.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys

KEY_ENV = "AREAL_SGLANG_API_KEY"
START_METHOD_ENV = "AREAL_SGLANG_START_METHOD"


def pin_start_method(method: str) -> None:
    """Make `method` multiprocessing's start method for this process, and SGLang's later
    `mp.set_start_method("spawn", force=True)` a no-op (it would replace it)."""
    if method not in multiprocessing.get_all_start_methods():
        raise SystemExit(
            f"{START_METHOD_ENV}={method!r}: not one of {multiprocessing.get_all_start_methods()}"
        )
    multiprocessing.set_start_method(method, force=True)

    def keep(requested: str | None, force: bool = False) -> None:  # SGLang's call
        del requested, force

    multiprocessing.set_start_method = keep


def main() -> None:
    key = os.environ.pop(KEY_ENV, "")
    if not key:
        raise SystemExit(f"{KEY_ENV} is empty: the server would be open to anyone; the launcher sets it")
    method = os.environ.pop(START_METHOD_ENV, "")
    if method:
        pin_start_method(method)
    sys.argv = [sys.argv[0], *sys.argv[1:], "--api-key", key]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
