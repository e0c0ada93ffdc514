"""Benchmarks run by `make bench`: each module exposes run(quick) -> dict[str, float] of flat metrics."""

import areal_jobs  # noqa: F401 - installs areal_jobs/moved.py: old module names work for a release
