"""CPU compatibility for Megatron-Core: run its training path on a CPU-only torch under gloo.

Why this exists: megatron-core 0.16.1 calls `torch.cuda.*` unconditionally (current_device, RNG
state, streams, synchronize) and creates tensors with `device="cuda"` on its training path (RoPE,
the attention scratch buffer, DDP grad buffers, the pipeline schedules, the optimizer's
`param.type() == "torch.cuda.FloatTensor"` asserts, the dist_checkpointing writer). On a torch
built without CUDA all of these raise, and no TransformerConfig flag avoids them
(reference/megatron-cpu.md). This module makes them CPU no-ops or CPU equivalents:

  1. `torch.cuda` functions Megatron calls -> CPU equivalents (RNG -> the CPU generator) or no-ops;
  2. a process-wide TorchFunctionMode that rewrites `device="cuda"`/`"cuda:N"`/int to CPU, makes
     `Tensor.cuda()`/`pin_memory()` return the tensor, and reports `Tensor.type()` with a
     `torch.cuda.` prefix (Megatron asserts on those strings);
  3. Megatron's RNG tracker reads and writes the CPU generator;
  4. the MoE alltoall token dispatcher's split sizes become host numpy arrays, as on GPU.

It is switched on only by `enable()`, which refuses to run when a CUDA device exists; GPU code
paths never import this module. It is a compatibility layer for CPU development and tests, not a
CPU backend: every torch call pays a small Python dispatch cost while it is on.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Self

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")
_mode: TorchFunctionMode | None = None


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # a bare ordinal means a CUDA device in torch APIs
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _NoOpCudaObject:
    """Stands in for streams and events: every method is a no-op, usable as a context manager."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __getattr__(self, name: str):
        if name == "record_event":  # the MoE alltoall dispatcher synchronizes on the event it records
            return lambda *args, **kwargs: _NoOpCudaObject()
        return lambda *args, **kwargs: None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        return func(*args, **kwargs)


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.Stream = _NoOpCudaObject
    cuda.Event = _NoOpCudaObject
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.current_stream = lambda *a, **k: _NoOpCudaObject()
    cuda.default_stream = lambda *a, **k: _NoOpCudaObject()
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    # torch.manual_seed calls cuda.manual_seed_all: forwarding it to the CPU generator would recurse
    cuda.manual_seed_all = lambda seed: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _patch_megatron_moe() -> None:
    """The MoE alltoall dispatcher moves its split sizes to the host as numpy arrays
    (`maybe_move_tensor_to_cpu(..., as_numpy=True)`), but only for CUDA tensors: on CPU they stay
    tensors, which `all_to_all_single` rejects ("incompatible function arguments")."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.detach().numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = to_host
    token_dispatcher.maybe_move_tensor_to_cpu = to_host

    # The dispatcher's all-to-all allocates its output on `torch.cuda.current_device()`; its
    # backward (another all-to-all) runs inside the autograd engine, where the process-wide mode
    # is not on: run the forward under the mode, whoever calls it.
    from megatron.core.tensor_parallel import mappings

    all_to_all_forward = mappings._AllToAll.forward

    def forward_on_cpu(ctx, *args):
        with _CudaToCpuMode():
            return all_to_all_forward(ctx, *args)

    mappings._AllToAll.forward = staticmethod(forward_on_cpu)

    # trainer.recompute=full runs each layer's forward again inside the autograd engine, without
    # the mode, and the router's gating moves a CPU weight to `torch.cuda.current_device()`: the
    # same wrapping for the recompute
    from megatron.core.tensor_parallel import random as megatron_random

    recompute_backward = megatron_random.CheckpointFunction.backward

    def backward_on_cpu(ctx, *args):
        with _CudaToCpuMode():
            return recompute_backward(ctx, *args)

    megatron_random.CheckpointFunction.backward = staticmethod(backward_on_cpu)


def enable() -> None:
    """Switch the compatibility layer on for this process (idempotent). CPU-only machines only."""
    global _mode
    if _mode is not None:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron_cpu_compat must not be enabled on a machine with a CUDA device")
    _patch_torch_cuda()
    _patch_megatron_rng()
    _patch_megatron_moe()
    _mode = _CudaToCpuMode()
    _mode.__enter__()  # stays on for the life of the process (torch function modes are per thread)
    logger.info("Megatron-Core CPU compatibility layer enabled (no CUDA device)")


def is_enabled() -> bool:
    return _mode is not None
