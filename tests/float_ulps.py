"""Float32 results judged in units of their own rounding: the distance to a float64 reference in
float32 ulps (the spacing of float32 at the reference's magnitude). An absolute bound such as 1e-6
is one CPU's rounding (AMD's kernels round differently from Intel's: two of them failed a bound of
2 ulps); a bound in ulps of the true value holds wherever float32 is float32, and a real bug (a
leak between sequences, a wrong mask, a wrong temperature) misses it by orders of magnitude."""

from __future__ import annotations

import numpy as np
import torch


def ulps_from(x: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """|x - truth| in float32 ulps of truth, elementwise (float64)."""
    truth64 = truth.detach().double().cpu()
    spacing = np.spacing(np.abs(truth64.numpy()).astype(np.float32)).astype(np.float64)
    return (x.detach().double().cpu() - truth64).abs() / torch.from_numpy(spacing)


def assert_within_ulps(
    x: torch.Tensor, truth: torch.Tensor, max_ulps: float, mean_ulps: float, what: str
) -> None:
    error = ulps_from(x, truth)
    assert x.shape == truth.shape, (what, x.shape, truth.shape)
    assert float(error.max()) <= max_ulps and float(error.mean()) <= mean_ulps, (
        f"{what}: {float(error.max()):.1f} ulps max (bound {max_ulps}), "
        f"{float(error.mean()):.2f} mean (bound {mean_ulps}) from the float64 reference"
    )
