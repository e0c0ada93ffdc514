"""requirements/apt_install.py, the first step of `make test`: missing system packages are
installed as root, or the exact command is printed and make stops; none is skipped silently."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("apt_install", REPO / "requirements" / "apt_install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_list_names_the_slurm_daemons_and_clients():
    packages = load_script().read_packages(REPO / "requirements" / "apt.txt")
    assert {"slurmctld", "slurmd", "slurm-client", "munge"} <= set(packages)


@pytest.fixture
def apt(monkeypatch, tmp_path):
    script = load_script()
    listing = tmp_path / "apt.txt"
    listing.write_text("# comment\nslurmd   # why\nbubblewrap\n")
    installed: list[list[str]] = []
    monkeypatch.setattr(script, "missing", lambda packages: [p for p in packages if p == "slurmd"])
    monkeypatch.setattr(script, "apt_install", installed.append)
    monkeypatch.setattr(script.shutil, "which", lambda name: f"/usr/bin/{name}")
    return script, listing, installed


def test_root_installs_only_what_is_missing(apt, monkeypatch):
    script, listing, installed = apt
    monkeypatch.setattr(script.os, "geteuid", lambda: 0)
    assert script.main([str(listing)]) == 0
    assert installed == [["slurmd"]]


def test_without_root_make_stops_with_the_command(apt, monkeypatch, capsys):
    script, listing, installed = apt
    monkeypatch.setattr(script.os, "geteuid", lambda: 1000)
    assert script.main([str(listing)]) == 1
    assert installed == []
    assert "sudo apt-get install -y --no-install-recommends slurmd" in capsys.readouterr().err


def test_dpkg_reports_an_installed_package():
    """The real dpkg query (this suite runs on Debian): dpkg itself is installed, a made-up name is not."""
    script = load_script()
    assert script.missing(["dpkg", "areal-no-such-package"]) == ["areal-no-such-package"]
