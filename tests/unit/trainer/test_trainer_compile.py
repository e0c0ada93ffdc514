"""`trainer.compile=true` (trainer/forward/layer_compile.py): each decoder layer compiled with inductor and
dynamic shapes, on CPU (inductor's C++ backend; ~30 s of compiling on 2 cores, once).

A tiny Qwen2 with layer recompute (the two compose: the checkpointed layer is the compiled
module), compiled, against the same model uncompiled: the packed log-probs within 4 float32 ulps
and every parameter's gradient within 64 ulps of its largest entry (inductor fuses and reorders
float32 sums), at two packed lengths, the second without a new graph (dynamic shapes). Megatron's
TransformerLayer compiles the same way (measured: 72 s of compiling on CPU, the step's loss equal
to 1.5e-8): left to bench/trainer/gpu_trainer.py, not the suite."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from areal_jobs.config import Attention
from areal_jobs.trainer.forward.attention import hf_attn_implementation
from areal_jobs.trainer.forward.hf_logprobs import enable_layer_recompute, token_logprobs
from areal_jobs.trainer.forward.layer_compile import check_compile_device, compile_layers, hf_decoder_layers
from areal_jobs.trainer.intake.batch import TrainSample

VOCAB = 97


def tiny_model():
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=hf_attn_implementation(Attention.varlen)
    )
    enable_layer_recompute(model)
    return model.train()


def samples(lengths, seed):
    rng = np.random.default_rng(seed)
    return [
        TrainSample(f"s{i}", rng.integers(1, VOCAB, p + n), p, np.zeros(n, np.float32), np.zeros(n, np.int32), 0.0, 0.0)
        for i, (p, n) in enumerate(lengths)
    ]  # fmt: skip


def step(model, batch):
    model.zero_grad(set_to_none=True)
    logp = torch.cat(token_logprobs(model, batch))
    logp.sum().backward()
    return logp.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_compiled_layers_give_the_same_logprobs_and_gradients():
    from torch._dynamo.utils import counters

    eager, compiled = tiny_model(), tiny_model()
    assert compile_layers(hf_decoder_layers(compiled)) == 2
    eps = torch.finfo(torch.float32).eps
    graphs = []
    for lengths, seed in (([(3, 40), (1, 1), (20, 150)], 5), ([(5, 60), (2, 31)], 6)):
        batch = samples(lengths, seed)
        (want, want_grads), (got, got_grads) = step(eager, batch), step(compiled, batch)
        graphs.append(counters["stats"]["unique_graphs"])
        assert float((got - want).abs().max()) <= 4 * eps * float(want.abs().max())
        for name, g in want_grads.items():
            assert float((got_grads[name] - g).abs().max()) <= 64 * eps * float(g.abs().max()), name
    assert graphs[0] > 0, "nothing was compiled"
    assert graphs[1] == graphs[0], "a new packed length compiled new graphs: shapes are not dynamic"


def test_no_compiler_on_cpu_is_refused_by_name(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ValueError, match="trainer.compile=false"):
        check_compile_device(None)
    check_compile_device(torch.device("cuda", 0))  # CUDA: inductor emits Triton, no C++ compiler


def test_nothing_to_compile_is_refused():
    with pytest.raises(ValueError, match="trainer.compile=false"):
        compile_layers(hf_decoder_layers(torch.nn.Linear(2, 2)))
