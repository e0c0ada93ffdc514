"""Install a virtual environment from requirement files: what `make install` runs (and any second venv).

    python3 requirements/pip_install.py --venv .venv -c requirements/constraints-cpu.txt \
        -r requirements/sglang-cpu.txt --no-deps sglang==0.5.23 -e ".[train,dev]"

Steps, each only when asked for: create the venv; upgrade pip; install every pin with a local
version label (`torch==2.13.0+cpu`) found in the -c/-r files; `pip install -c ... -r ...`;
`pip install --no-deps ...`; `pip install -c ... -e ...`.

A local-version wheel is not served by a stock package index (PyPI has no `+cpu` torch): such a pin
is tried on the index pip is configured with first and, when that has none, installed from
TORCH_INDEX_URL (default PyTorch's CPU wheel index, https://download.pytorch.org/whl/cpu) added as
an extra index. Later steps find it installed and leave it alone.

Idempotent: the venv records a digest of its inputs (these arguments and the content of every file
they name) in <venv>/.installed, and a rerun with the same digest does nothing. A venv that is a
symlink belongs to another checkout and is never reinstalled from here. Standard library only: it
runs before the venv exists.

Disk: the CPU venv takes 3.7 GB and the vLLM one 3.4 GB (measured on a clean clone), and pip unpacks
each wheel in TMPDIR on the way. With less than NEEDED_FREE_GB free the install warns before it
starts, and a pip step that fails for want of space says where and how much was free: a CI run once
failed with pip's bare "[Errno 28] No space left on device" when the machine's disk was full.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_TORCH_INDEX_URL = "https://download.pytorch.org/whl/cpu"
STAMP = ".installed"
NEEDED_FREE_GB = 6.0  # one venv (3.7 GB) plus room for the largest wheels unpacked in TMPDIR
NO_SPACE = "No space left on device"
# `name==version+local`, the whole requirement (no markers, no extras), as in our pin files
LOCAL_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([0-9][^\s;#+]*\+[A-Za-z0-9.]+)\s*(#.*)?$")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--venv", type=Path, required=True, help="the virtual environment (created if absent)"
    )
    parser.add_argument("-c", dest="constraints", action="append", default=[], help="constraints file")
    parser.add_argument("-r", dest="requirements", action="append", default=[], help="requirements file")
    parser.add_argument("--no-deps", action="append", default=[], help="a requirement installed without deps")
    parser.add_argument("-e", dest="editable", help="an editable install, e.g. '.[train,dev]'")
    parser.add_argument(
        "--torch-index-url",
        default=os.environ.get("TORCH_INDEX_URL") or DEFAULT_TORCH_INDEX_URL,
        help="where local-version pins come from when pip's index has none (env TORCH_INDEX_URL)",
    )
    return parser.parse_args(argv)


def local_pins(files: list[str]) -> list[str]:
    """`name==version+local` pins in `files`, first occurrence of each name, in file order."""
    pins: dict[str, str] = {}
    for file in files:
        for line in Path(file).read_text().splitlines():
            match = LOCAL_PIN.match(line)
            if match:
                pins.setdefault(match.group(1).lower(), f"{match.group(1)}=={match.group(2)}")
    return list(pins.values())


def digest(args: argparse.Namespace) -> str:
    """What the venv is built from: the arguments and every file they name."""
    h = hashlib.sha256()
    h.update(repr((args.constraints, args.requirements, args.no_deps, args.editable)).encode())
    files = [*args.constraints, *args.requirements]
    if args.editable:
        project = Path(args.editable.split("[", 1)[0])
        files += [str(project / name) for name in ("setup.cfg", "setup.py", "pyproject.toml")]
    for file in files:
        if Path(file).is_file():
            h.update(file.encode() + b"\0" + Path(file).read_bytes())
    return h.hexdigest()


def pip(venv: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    if proc.stdout:
        print(proc.stdout, end="", flush=True)
    if check and proc.returncode != 0:
        hint = (
            f"\n{disk_report(disk_free_gb(venv))}: free space there, or set VENV / TMPDIR to a bigger disk"
            if NO_SPACE in (proc.stdout or "")
            else ""
        )
        raise SystemExit(f"pip failed ({proc.returncode}): {' '.join(cmd)}{hint}")
    return proc


def free_gb(path: Path) -> float:
    """Free space on the file system holding `path` (its nearest existing ancestor)."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free / 1e9


def disk_free_gb(venv: Path) -> dict[str, tuple[Path, float]]:
    """Where the install writes (the venv, and TMPDIR where pip unpacks) and the GB free there."""
    places = {"the venv": venv, "TMPDIR": Path(tempfile.gettempdir())}
    return {what: (where, free_gb(where)) for what, where in places.items()}


def disk_report(free: dict[str, tuple[Path, float]]) -> str:
    return "; ".join(f"{gb:.1f} GB free for {what} ({where})" for what, (where, gb) in free.items())


def warn_if_short_of_disk(venv: Path) -> None:
    free = disk_free_gb(venv)
    if min(gb for _, gb in free.values()) < NEEDED_FREE_GB:
        print(
            f"warning: installing {venv} needs about {NEEDED_FREE_GB:.0f} GB; {disk_report(free)}",
            file=sys.stderr,
            flush=True,
        )


def installed_version(venv: Path, name: str) -> str | None:
    code = f"import importlib.metadata as m\ntry: print(m.version({name!r}))\nexcept m.PackageNotFoundError: pass"
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True
    )
    return out.stdout.strip() or None


def install_local_pin(venv: Path, pin: str, torch_index_url: str) -> None:
    """The pinned local-version wheel: from pip's own index when it has it, else from torch_index_url."""
    name, version = pin.split("==")
    if installed_version(venv, name) == version:
        return
    if pip(venv, pin, check=False).returncode == 0:
        return
    print(
        f"the package index has no {pin}: trying {torch_index_url} (set TORCH_INDEX_URL to change)",
        flush=True,
    )
    if pip(venv, "--extra-index-url", torch_index_url, pin, check=False).returncode != 0:
        raise SystemExit(
            f"{pin} is neither on the package index nor on {torch_index_url}: point TORCH_INDEX_URL at an "
            f"index that serves it (PyTorch's CPU wheels: {DEFAULT_TORCH_INDEX_URL})"
        )


def install(args: argparse.Namespace) -> None:
    venv: Path = args.venv
    warn_if_short_of_disk(venv)
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip(venv, "-U", "pip")
    constraints = [arg for file in args.constraints for arg in ("-c", file)]
    for pin in local_pins([*args.constraints, *args.requirements]):
        install_local_pin(venv, pin, args.torch_index_url)
    if args.requirements:
        pip(venv, *constraints, *[arg for file in args.requirements for arg in ("-r", file)])
    if args.no_deps:
        pip(venv, "--no-deps", *args.no_deps)
    if args.editable:
        pip(venv, *constraints, "-e", args.editable)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = args.venv / STAMP
    wanted = digest(args)
    if stamp.exists() and stamp.read_text().strip() == wanted:
        return 0
    if args.venv.is_symlink():
        print(
            f"{args.venv} is a symlink to {os.path.realpath(args.venv)}, a venv another checkout owns: "
            "not reinstalling it from here (install from that checkout)",
            file=sys.stderr,
        )
        return 0
    install(args)
    stamp.write_text(wanted + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
