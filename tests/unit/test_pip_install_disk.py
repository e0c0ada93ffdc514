"""requirements/pip_install.py when the disk is full: a pip step that fails for want of space says
how much was free where and what to change, instead of pip's bare "[Errno 28]" (as a CI run once
failed), and a short disk is warned about before the install starts. pip itself is a stand-in
script here (a real subprocess); the real install is tests/integration/install."""

from __future__ import annotations

import importlib.util
import stat
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "requirements" / "pip_install.py"


@pytest.fixture()
def pip_install():
    spec = importlib.util.spec_from_file_location("pip_install_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_venv(root: Path, output: str, rc: int) -> Path:
    """A venv whose python prints `output` and exits `rc`, whatever it is asked."""
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\ncat <<'OUT'\n{output}\nOUT\nexit {rc}\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return venv


def test_a_full_disk_names_the_free_space_and_what_to_change(pip_install, tmp_path):
    venv = fake_venv(
        tmp_path, "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device", 1
    )
    with pytest.raises(SystemExit) as failed:
        pip_install.pip(venv, "some-package")
    message = str(failed.value)
    assert message.startswith("pip failed (1):")
    assert "GB free for the venv" in message and "GB free for TMPDIR" in message
    assert "set VENV / TMPDIR to a bigger disk" in message


def test_other_failures_keep_the_plain_message(pip_install, tmp_path):
    venv = fake_venv(tmp_path, "ERROR: No matching distribution found for some-package", 1)
    with pytest.raises(SystemExit) as failed:
        pip_install.pip(venv, "some-package")
    assert "GB free" not in str(failed.value)


def test_a_short_disk_is_warned_about_before_installing(pip_install, tmp_path, capsys, monkeypatch):
    venv = tmp_path / "not-yet" / "venv"  # free space is read off its nearest existing parent
    monkeypatch.setattr(pip_install, "NEEDED_FREE_GB", 0.0)
    pip_install.warn_if_short_of_disk(venv)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(pip_install, "NEEDED_FREE_GB", 1e12)  # more than any disk here
    pip_install.warn_if_short_of_disk(venv)
    warning = capsys.readouterr().err
    assert warning.startswith(f"warning: installing {venv} needs about")
    assert "GB free for the venv" in warning
