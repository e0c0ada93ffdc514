"""CPU stand-in for sgl-kernel (see ../README.md). Only the op the CPU text path calls is real."""

import torch

__version__ = "0.0.0+areal-jobs-cpu-stub"


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """Write each request's new KV-cache slots into its row of the request-to-token table."""
    cursor = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        count = end - start
        if count > 0:
            req_to_token[row, start:end] = out_cache_loc[cursor : cursor + count].to(req_to_token.dtype)
        cursor += max(count, 0)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU implementation in the areal_jobs stub")

    unavailable.__name__ = name
    return unavailable


_ = torch  # torch must be importable wherever this stub is used
