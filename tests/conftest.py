"""Fixtures shared by unit and integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The built-in tokenizer and a randomly initialised tiny Qwen2 (no warm start): seconds to build."""
    from areal_jobs.data.tiny_model import TinyRecipe, build_builtin_model

    return build_builtin_model(tmp_path_factory.mktemp("tiny-model"), TinyRecipe(sft_steps=0), threads=1)
