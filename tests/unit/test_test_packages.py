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


def test_no_test_imports_from_a_conftest():
    """Several test folders have a conftest.py, all imported as the module `conftest`: which one
    `from conftest import X` finds depends on the order pytest loaded them (`pytest
    tests/integration/slurm tests/integration/vllm`, as `make test-repeat` runs, found vllm's and
    failed to collect every SLURM test). Helpers live in a module of their own name."""
    offenders = [
        str(path.relative_to(TESTS.parent))
        for path in sorted(TESTS.rglob("*.py"))
        if any(
            line.strip().startswith(("from conftest import", "import conftest"))
            for line in path.read_text(encoding="utf-8").splitlines()
        )
    ]
    assert offenders == [], f"import these helpers from a module named for them, not conftest: {offenders}"


def test_helper_modules_have_names_of_their_own():
    """A helper module outside a package is imported by its bare name (rootdir "prepend" mode): two
    with one name in different folders would take each other's place in sys.modules."""
    seen: dict[str, list[str]] = {}
    for path in TESTS.rglob("*.py"):
        if path.name in ("conftest.py", "__init__.py") or (path.parent / "__init__.py").exists():
            continue
        seen.setdefault(path.stem, []).append(str(path.relative_to(TESTS.parent)))
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}
