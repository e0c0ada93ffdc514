"""Install the system packages a list names (requirements/apt.txt): what `make test` runs first.

    python3 requirements/apt_install.py requirements/apt.txt

Packages already installed (dpkg says so) are left alone. Missing ones are installed when this
runs as root on a machine with apt-get, without starting their system services (a policy-rc.d
that refuses them is in place during the install, removed after); otherwise it exits non-zero with
the exact command to run. On a machine without dpkg it only lists what the tests expect. Standard
library only: it runs before the venv exists.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

POLICY_RC_D = Path("/usr/sbin/policy-rc.d")  # apt asks it whether to start a service; 101 = no


def read_packages(path: Path) -> list[str]:
    names = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    return [name for name in names if name]


def missing(packages: list[str]) -> list[str]:
    """Packages dpkg does not report as installed."""
    absent = []
    for name in packages:
        status = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", name], capture_output=True, text=True, check=False
        ).stdout
        if status.strip() != "install ok installed":
            absent.append(name)
    return absent


def apt_install(packages: list[str]) -> None:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    placed = not POLICY_RC_D.exists()
    if placed:
        POLICY_RC_D.write_text("#!/bin/sh\nexit 101\n")
        POLICY_RC_D.chmod(0o755)
    try:
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=True)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
            env=env, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        if placed:
            POLICY_RC_D.unlink()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python3 requirements/apt_install.py requirements/apt.txt", file=sys.stderr)
        return 2
    packages = read_packages(Path(argv[0]))
    if shutil.which("dpkg-query") is None:
        print(
            f"not a Debian-like system: the tests expect these (Debian names): {' '.join(packages)}",
            file=sys.stderr,
        )
        return 0
    absent = missing(packages)
    if not absent:
        return 0
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print(f"installing system packages: {' '.join(absent)}", flush=True)
        apt_install(absent)
        return 0
    command = f"sudo apt-get update && sudo apt-get install -y --no-install-recommends {' '.join(absent)}"
    print(
        f"the tests need system packages that are not installed: {' '.join(absent)}\nrun:  {command}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
