"""`trainer.compile=true`: torch.compile each decoder layer, with dynamic shapes (torchtitan's RL
trainer does the same per transformer block).

One compiled graph per layer class, not per model: every layer runs the same code, so the layers
share the compiled artefacts (their parameters are graph inputs), and compile time does not grow
with depth. Dynamic shapes: a packed micro-batch has a new length each time; a static compile
would recompile per length. The packed attention call is excluded from the graphs
(`torch.compiler.disable` in trainer/forward/attention.py and megatron/attention.py: its sequence
boundaries are Python ints, which would specialise the graph per micro-batch); FlexAttention
compiles itself. The LM head (trainer/forward/logprobs.py) is outside the layers and stays eager.

Recompute composes: HF gradient checkpointing and Megatron's full recompute call the layer,
which is the compiled module, again in backward.

Inductor needs a C++ compiler on CPU and Triton on CUDA; the first step pays the compile.
"""

from __future__ import annotations

import logging
import shutil

import torch

logger = logging.getLogger(__name__)


def check_compile_device(device: torch.device | None) -> None:
    """Inductor builds C++ kernels on CPU: refuse up front, naming the override, where no compiler is."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if not on_cuda and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        raise ValueError(
            "trainer.compile=true compiles the decoder layers with inductor, which needs a C++ compiler "
            "on CPU (none on PATH): install g++ or set trainer.compile=false"
        )


def compile_layers(layers: list[torch.nn.Module]) -> int:
    """Compile each module in place (`nn.Module.compile`, dynamic shapes); returns how many."""
    if not layers:
        raise ValueError("trainer.compile=true found no decoder layers to compile: set trainer.compile=false")
    for layer in layers:
        layer.compile(dynamic=True)
    logger.info("trainer.compile: %d decoder layers compiled (%s)", len(layers), type(layers[0]).__name__)
    return len(layers)


def hf_decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers model: the classes it names in `_no_split_modules`
    (or their subclasses: fully_shard turns a layer's class into an FSDP subclass of it)."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if any(c.__name__ in blocks for c in type(m).__mro__)]


def megatron_decoder_layers(gpt: torch.nn.Module) -> list[torch.nn.Module]:
    """This pipeline stage's TransformerLayers."""
    decoder = getattr(gpt, "decoder", None)
    return list(decoder.layers) if decoder is not None else []
