"""A test folder with an __init__.py is imported by pytest as a top-level package named after the
folder (rootdir "prepend" mode). Named like a library (tests/integration/sglang once was), it takes
that library's place in sys.modules for the rest of the session, and fails to load at all where the
library was imported first. Every test package must have a name no library uses."""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# Libraries the project runs, some of them only in a venv of their own (vLLM): never a test package name.
ENGINES = {"sglang", "vllm", "torch", "megatron", "transformers", "transformer_engine"}


def top_level_test_packages() -> dict[str, Path]:
    """Name pytest gives each outermost test package -> its folder."""
    packages = {}
    for init in TESTS.rglob("__init__.py"):
        folder = init.parent
        while (folder.parent / "__init__.py").exists():
            folder = folder.parent
        packages[folder.name] = folder
    return packages


def test_no_test_package_shadows_an_importable_module():
    outside = [p for p in sys.path if p and not Path(p).resolve().is_relative_to(TESTS)]
    shadowing = {
        name: str(folder.relative_to(TESTS.parent))
        for name, folder in top_level_test_packages().items()
        if name in ENGINES
        or name in sys.stdlib_module_names
        or importlib.machinery.PathFinder.find_spec(name, outside) is not None
    }
    assert shadowing == {}, f"rename these test packages, or drop their __init__.py: {shadowing}"
