"""`python -m sglang.launch_server`, with the API key taken from the environment, not the command line.

SGLang 0.5.23 reads its API key only from `--api-key` (or a `--config` YAML file); there is no
environment variable for it. On the command line, every user of the node reads it with `ps`
(/proc/<pid>/cmdline is world-readable). This module runs as the server's main program: it takes
the key from AREAL_SGLANG_API_KEY (the launcher sets it; /proc/<pid>/environ is readable by the
owner only), removes it from the environment SGLang's children inherit, appends `--api-key` to
sys.argv (Python's copy of the arguments: the kernel's copy, which `ps` shows, is unchanged) and
runs sglang.launch_server as __main__, exactly as `-m` would (spawned children re-import it by name).
Standard library only: it runs before SGLang is imported.
"""

from __future__ import annotations

import os
import runpy
import sys

KEY_ENV = "AREAL_SGLANG_API_KEY"


def main() -> None:
    key = os.environ.pop(KEY_ENV, "")
    if not key:
        raise SystemExit(f"{KEY_ENV} is empty: the server would be open to anyone; the launcher sets it")
    sys.argv = [sys.argv[0], *sys.argv[1:], "--api-key", key]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
