"""`make install`'s pip step (requirements/pip_install.py) on a machine whose package index does
not serve the pinned `torch==2.13.0+cpu`, as on any stock index: the wheel comes from the index in
TORCH_INDEX_URL instead, and later steps keep it.

Two local directory indexes stand in for the world: "pypi" serves torch 2.13.0 (no +cpu) and an app
that requires torch==2.13.0 (as SGLang's CPU list does); "pytorch" serves torch 2.13.0+cpu. The
wheels are tiny ones built here; pip, the venv and the script are the real ones, offline.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "requirements" / "pip_install.py"


def build_wheel(folder: Path, name: str, version: str, origin: str, requires: tuple[str, ...] = ()) -> None:
    """A pure-Python wheel whose module `name` says which index it came from."""
    module = name.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    files = {
        f"{module}.py": f"ORIGIN = {origin!r}\n",
        f"{dist_info}/METADATA": "Metadata-Version: 2.1\n"
        f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: areal-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(body.encode()).digest()).rstrip(b'=').decode()},"
        f"{len(body.encode())}\n"
        for path, body in files.items()
    )
    files[f"{dist_info}/RECORD"] = record + f"{dist_info}/RECORD,,\n"
    project = folder / name
    project.mkdir(parents=True, exist_ok=True)
    wheel = f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(project / wheel, "w") as zf:
        for path, body in files.items():
            zf.writestr(path, body)
    links = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in sorted(project.glob("*.whl")))
    (project / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("indexes")
    pypi, pytorch, both = root / "pypi", root / "pytorch", root / "pypi-with-cpu"
    for index in (pypi, both):
        build_wheel(index, "torch", "2.13.0", "pypi")
        build_wheel(index, "probe-app", "1.0", "pypi", requires=("torch==2.13.0",))
    build_wheel(pytorch, "torch", "2.13.0+cpu", "pytorch")
    build_wheel(both, "torch", "2.13.0+cpu", "pypi")
    (root / "constraints.txt").write_text("# as requirements/constraints-cpu.txt\ntorch==2.13.0+cpu\n")
    (root / "app.txt").write_text("torch==2.13.0\nprobe-app\n")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    return {"root": root, "pypi": pypi, "pytorch": pytorch, "both": both, "venv": venv}


def install(world: dict[str, Path], index: Path, torch_index: Path) -> subprocess.CompletedProcess[str]:
    """The script as the Makefile runs it, with pip seeing only `index` (no machine config)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_INDEX_URL=index.as_uri(),
        PIP_NO_CACHE_DIR="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        TORCH_INDEX_URL=torch_index.as_uri(),
    )
    args = [
        "--venv",
        str(world["venv"]),
        "-c",
        str(world["root"] / "constraints.txt"),
        "-r",
        str(world["root"] / "app.txt"),
    ]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    print(proc.stdout, proc.stderr)
    return proc


def installed(world: dict[str, Path]) -> str:
    code = "import importlib.metadata as m, torch; print(m.version('torch'), torch.ORIGIN, m.version('probe-app'))"
    venv_python = str(world["venv"] / "bin" / "python")
    return subprocess.run(
        [venv_python, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def reset(world: dict[str, Path]) -> None:
    venv_python = str(world["venv"] / "bin" / "python")
    subprocess.run([venv_python, "-m", "pip", "uninstall", "-q", "-y", "torch", "probe-app"], check=False)
    (world["venv"] / ".installed").unlink(missing_ok=True)


def test_the_cpu_wheel_comes_from_torch_index_url_when_the_index_lacks_it(world):
    reset(world)
    proc = install(world, index=world["pypi"], torch_index=world["pytorch"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"the package index has no torch==2.13.0+cpu: trying {world['pytorch'].as_uri()}" in proc.stdout
    assert installed(world) == "2.13.0+cpu pytorch 1.0"
    again = install(world, index=world["pypi"], torch_index=world["pytorch"])
    assert (again.returncode, again.stdout) == (0, "")  # the digest matches: nothing to do


def test_the_index_is_used_first_when_it_serves_the_cpu_wheel(world):
    reset(world)
    nowhere = world["root"] / "no-such-index"
    proc = install(world, index=world["both"], torch_index=nowhere)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trying" not in proc.stdout
    assert installed(world) == "2.13.0+cpu pypi 1.0"


def test_no_wheel_anywhere_names_the_variable_to_set(world):
    reset(world)
    proc = install(world, index=world["pypi"], torch_index=world["pypi"])
    assert proc.returncode != 0
    assert "torch==2.13.0+cpu is neither on the package index nor on" in proc.stderr
    assert "TORCH_INDEX_URL" in proc.stderr
