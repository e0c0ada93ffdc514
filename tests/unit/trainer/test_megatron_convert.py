"""The HF <-> Megatron state-dict adapter: pure tensor rules, no megatron, no distributed."""

from __future__ import annotations

import pytest
import torch

from areal_jobs.trainer.megatron.convert import (
    Kind,
    ModelDims,
    ParamMap,
    full_to_hf,
    hf_shapes,
    hf_to_full,
    hf_to_megatron_shard,
    merge_tp,
    padded_vocab_size,
    param_maps,
    split_tp,
    stage_layers,
)


def hf_config(model_type: str = "qwen2", **overrides) -> dict:
    cfg = {
        "model_type": model_type,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 100,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    cfg.update(overrides)
    return cfg


def dims(model_type: str = "qwen2", **overrides) -> ModelDims:
    return ModelDims.from_hf_config(hf_config(model_type, **overrides), vocab_multiple=64)


def random_hf_state(d: ModelDims) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    state = {}
    for stage in range(d.num_layers):  # pp = num_layers: one layer per stage covers every name
        for pm in param_maps(d, pp_size=d.num_layers, pp_rank=stage, te_fused_norms=False):
            for name, shape in zip(pm.hf_names, hf_shapes(pm, d), strict=True):
                state.setdefault(name, torch.randn(shape, generator=gen))
    return state


def test_qkv_is_grouped_query_heads_then_key_then_value():
    d = dims(num_attention_heads=4, num_key_value_heads=2, head_dim=1, hidden_size=4)
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # heads 0..3, groups {0,1} and {2,3}
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    pm = ParamMap("x.linear_qkv.bias", Kind.qkv, ("q", "k", "v"))
    full = hf_to_full(pm, [q[:, 0], k[:, 0], v[:, 0]], d)
    assert full.tolist() == [10.0, 11.0, 20.0, 30.0, 12.0, 13.0, 21.0, 31.0]
    # TP=2: each rank gets whole groups
    assert [s.tolist() for s in split_tp(pm, full, 2)] == [
        [10.0, 11.0, 20.0, 30.0],
        [12.0, 13.0, 21.0, 31.0],
    ]


def test_gate_up_shards_hold_their_half_of_each():
    pm = ParamMap("x.linear_fc1.weight", Kind.gate_up, ("gate", "up"))
    gate, up = torch.arange(4.0)[:, None], 10 + torch.arange(4.0)[:, None]
    full = hf_to_full(pm, [gate, up], dims())
    shards = split_tp(pm, full, 2)
    assert [s[:, 0].tolist() for s in shards] == [
        [0.0, 1.0, 10.0, 11.0],
        [2.0, 3.0, 12.0, 13.0],
    ]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_every_kind_round_trips_bit_exact(family, tp):
    d = dims(family)
    state = random_hf_state(d)
    for pm in param_maps(d, pp_size=1, pp_rank=0, te_fused_norms=False):
        tensors = [state[n] for n in pm.hf_names]
        full = hf_to_full(pm, tensors, d)
        shards = split_tp(pm, full, tp)
        assert len(shards) == tp
        assert torch.equal(merge_tp(pm, shards), full)
        back = full_to_hf(pm, merge_tp(pm, shards), d)
        assert all(torch.equal(a, b) for a, b in zip(back, tensors, strict=True)), pm.megatron_name


def test_vocab_is_padded_with_zero_rows_and_trimmed_on_export():
    d = dims(vocab_size=100)
    assert d.padded_vocab_size == 128
    pm = ParamMap("embedding.word_embeddings.weight", Kind.vocab, ("model.embed_tokens.weight",))
    emb = torch.randn(100, 32)
    full = hf_to_full(pm, [emb], d)
    assert full.shape == (128, 32) and torch.equal(full[100:], torch.zeros(28, 32))
    assert torch.equal(full_to_hf(pm, full, d)[0], emb)


def test_padded_vocab_does_not_depend_on_tp():
    assert padded_vocab_size(151936, 128) == 151936
    assert padded_vocab_size(151937, 128) == 152064
    assert padded_vocab_size(384, 128) == 384


def test_shard_at_tp2_merges_to_the_tp1_tensors():
    d = dims("qwen3")
    state = random_hf_state(d)
    full = hf_to_megatron_shard(state.__getitem__, d, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0)
    halves = [
        hf_to_megatron_shard(state.__getitem__, d, tp_size=2, tp_rank=r, pp_size=1, pp_rank=0) for r in (0, 1)
    ]
    for pm in param_maps(d, pp_size=1, pp_rank=0, te_fused_norms=False):
        assert torch.equal(merge_tp(pm, [h[pm.megatron_name] for h in halves]), full[pm.megatron_name])


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_pipeline_stages_export_every_hf_tensor_once(pp, tied):
    d = dims("qwen2", tie_word_embeddings=tied)
    expected = set(random_hf_state(d))
    exported: list[str] = []
    for stage in range(pp):
        maps = param_maps(d, pp_size=pp, pp_rank=stage, te_fused_norms=False)
        exported += [n for pm in maps if pm.exported for n in pm.hf_names]
        layers = [
            pm.megatron_name.split(".")[2] for pm in maps if pm.megatron_name.startswith("decoder.layers.")
        ]
        assert sorted(set(layers), key=int) == [str(i) for i in range(d.num_layers // pp)]  # local numbering
        hidden = [pm for pm in maps if not pm.exported]
        if tied and pp > 1 and stage == pp - 1:  # the last stage's copy of the tied embedding
            assert [pm.megatron_name for pm in hidden] == ["output_layer.weight"]
            assert hidden[0].hf_names == ("model.embed_tokens.weight",)
        else:
            assert hidden == []
    assert sorted(exported) == sorted(expected)
    assert len(exported) == len(set(exported))
    assert ("lm_head.weight" in expected) is (not tied)
    assert list(stage_layers(d, pp, pp - 1))[-1] == d.num_layers - 1


def test_te_spec_names_fused_norms():
    maps = param_maps(dims(), pp_size=1, pp_rank=0, te_fused_norms=True)
    names = {pm.megatron_name for pm in maps}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_names_and_shapes_are_those_of_transformers(family):
    import transformers

    config_cls = {
        "llama": "LlamaConfig",
        "qwen2": "Qwen2Config",
        "qwen3": "Qwen3Config",
    }[family]
    model_cls = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }[family]
    cfg = getattr(transformers, config_cls)(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
    )
    model = getattr(transformers, model_cls)(cfg)
    hf = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    d = ModelDims.from_hf_config(cfg.to_dict())
    ours = {
        n: s
        for pm in param_maps(d, pp_size=1, pp_rank=0, te_fused_norms=False)
        for n, s in zip(pm.hf_names, hf_shapes(pm, d), strict=True)
    }
    assert ours == hf
    assert (d.qkv_bias, d.qk_norm) == (family == "qwen2", family == "qwen3")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_attention_bias_maps_qkv_and_o_proj_biases(family):
    """attention_bias (Llama, Qwen3; Qwen3-MoE's built-in model has it): q/k/v and o_proj carry a
    bias, as transformers builds them; o_proj's is the row-parallel linear's (replicated)."""
    import transformers

    config_cls, model_cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }[family]
    cfg = getattr(transformers, config_cls)(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=100, attention_bias=True,
    )  # fmt: skip
    hf = {k: tuple(v.shape) for k, v in getattr(transformers, model_cls)(cfg).state_dict().items()}
    d = ModelDims.from_hf_config(cfg.to_dict())
    maps = param_maps(d, pp_size=1, pp_rank=0, te_fused_norms=False)
    ours = {n: s for pm in maps for n, s in zip(pm.hf_names, hf_shapes(pm, d), strict=True)}
    assert ours == hf
    (o_bias,) = [pm for pm in maps if pm.megatron_name.endswith("linear_proj.bias")]
    assert o_bias.kind is Kind.replicated and d.qkv_bias and d.o_bias


def test_config_parsing():
    d = dims("llama", rope_parameters=None, rope_theta=5e5, head_dim=None)
    assert d.rope_theta == 5e5 and d.head_dim == 8 and d.heads_per_group == 2
    assert dims().rope_theta == 1e6


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model_type": "mistral"}, "model_type"),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 1e4,
                    "factor": 8.0,
                }
            },
            "rope scaling",
        ),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_configs_are_rejected(overrides, message):
    cfg = hf_config()
    cfg.update(overrides)
    with pytest.raises(ValueError, match=message):
        ModelDims.from_hf_config(cfg)


def test_layouts_that_do_not_divide_are_rejected():
    d = dims()  # 2 KV heads, 4 layers
    d.check_layout(2, 4)
    with pytest.raises(ValueError, match="trainer.tp_size"):
        d.check_layout(4, 1)
    with pytest.raises(ValueError, match="trainer.pp_size"):
        d.check_layout(1, 3)
