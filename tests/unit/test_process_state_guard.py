"""The guard in tests/conftest.py: a session fixture that leaves os.environ changed for the tests
after it (as the SLURM cluster fixture once did with SLURM_CONF) fails the first test that uses it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LEAKY = """
import os, signal
import pytest

@pytest.fixture(scope="session")
def leaky():
    os.environ["AREAL_LEAKED"] = "1"
    yield
    os.environ.pop("AREAL_LEAKED")

def test_before():
    pass

def test_uses_the_leaky_fixture(leaky):
    pass

def test_after(monkeypatch):
    monkeypatch.setenv("AREAL_SCOPED", "1")  # undone by monkeypatch: not a leak

def test_signal_handler_left_behind():
    signal.signal(signal.SIGUSR2, lambda *_: None)
"""


def test_a_leaking_fixture_fails_its_first_test_only(tmp_path: Path) -> None:
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    out = proc.stdout
    assert "4 passed, 2 errors" in out, out
    assert "ERROR at teardown of test_uses_the_leaky_fixture" in out, out
    assert "os.environ['AREAL_LEAKED'] set" in out, out
    assert "ERROR at teardown of test_signal_handler_left_behind" in out and "SIGUSR2 handler" in out, out
