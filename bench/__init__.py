"""Benchmarks run by `make bench`: each module exposes run(quick) -> dict[str, float] of flat metrics."""
