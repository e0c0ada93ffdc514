"""The HF <-> Megatron adapter for Qwen3-MoE: expert names, expert-parallel slots, expert TP, and
the settings that give Megatron's MoE layer the HF router's numerics (issue 44)."""

from __future__ import annotations

import pytest
import torch

from areal_jobs.trainer.megatron.convert import (
    Kind,
    ModelDims,
    ep_peer,
    hf_shapes,
    hf_to_megatron_shard,
    merge_tp,
    param_maps,
)


def moe_config(**overrides) -> dict:
    cfg = {
        "model_type": "qwen3_moe",
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 100,
        "num_local_experts": 4,  # transformers 5 writes num_experts under this name
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "attention_bias": True,
        "router_aux_loss_coef": 0.01,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    }
    cfg.update(overrides)
    return cfg


def moe_dims(**overrides) -> ModelDims:
    return ModelDims.from_hf_config(moe_config(**overrides), vocab_multiple=64)


def hf_state(d: ModelDims) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(shape, generator=gen)
        for pm in param_maps(d, pp_size=1, pp_rank=0, te_fused_norms=False)
        for name, shape in zip(pm.hf_names, hf_shapes(pm, d), strict=True)
    }


def test_config_parsing():
    d = moe_dims()
    assert (d.num_experts, d.moe_topk, d.moe_ffn_hidden_size) == (4, 2, 24)
    assert d.is_moe and d.norm_topk_prob and d.router_aux_loss_coef == 0.01
    assert d.qk_norm and d.qkv_bias and d.o_bias  # attention_bias: q/k/v and o_proj
    assert moe_dims(num_experts=8, num_local_experts=None).num_experts == 8
    assert not ModelDims.from_hf_config({**moe_config(), "model_type": "qwen3"}).is_moe


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({"shared_expert_intermediate_size": 16}, "shared experts"),
    ],
)
def test_unmapped_moe_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        moe_dims(**overrides)


def test_layouts_name_the_override():
    d = moe_dims()
    d.check_layout(1, 2, 4, 2)
    with pytest.raises(
        ValueError, match=r"trainer\.tp_size=2 with a mixture of experts.*set trainer\.tp_size=1"
    ):
        d.check_layout(2, 1, 2)
    with pytest.raises(ValueError, match=r"trainer\.ep_size=3 must divide the model's 4 experts"):
        d.check_layout(1, 1, 3)
    with pytest.raises(ValueError, match=r"trainer\.expert_tp_size=5"):
        d.check_layout(1, 1, 1, 5)
    dense = ModelDims.from_hf_config({**moe_config(), "model_type": "qwen3"})
    with pytest.raises(ValueError, match=r"trainer\.ep_size=2 .*dense.*set both to 1"):
        dense.check_layout(1, 1, 2)


def test_names_and_shapes_are_those_of_a_transformers_checkpoint():
    """transformers 5 fuses a layer's experts in memory; its checkpoints (and the engines) name
    them per expert: compare with save_pretrained's own reverse conversion."""
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in moe_config().items() if k != "model_type"})
    model = transformers.Qwen3MoeForCausalLM(cfg)
    state = revert_weight_conversion(model, model.state_dict())
    state.pop("lm_head.weight", None)  # tied: the checkpoint holds the embedding only
    hf = {k: tuple(v.shape) for k, v in state.items()}
    d = ModelDims.from_hf_config(cfg.to_dict())
    ours = {
        n: s
        for pm in param_maps(d, pp_size=1, pp_rank=0, te_fused_norms=False)
        for n, s in zip(pm.hf_names, hf_shapes(pm, d), strict=True)
    }
    assert ours == hf


def test_megatron_names_of_an_moe_layer():
    names = [pm.megatron_name for pm in param_maps(moe_dims(), pp_size=1, pp_rank=0, te_fused_norms=False)]
    layer0 = [n.removeprefix("decoder.layers.0.") for n in names if n.startswith("decoder.layers.0.")]
    assert "self_attention.linear_proj.bias" in layer0
    assert "mlp.router.weight" in layer0 and "pre_mlp_layernorm.weight" in layer0
    assert "mlp.experts.local_experts.3.linear_fc2.weight" in layer0
    assert not any("linear_fc1" in n and "experts" not in n for n in layer0)  # no dense MLP
    # the TE spec fuses the input norm into qkv, but an MoE layer's norm stays its own module
    te = {pm.megatron_name for pm in param_maps(moe_dims(), pp_size=1, pp_rank=0, te_fused_norms=True)}
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in te
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_parallel_ranks_hold_disjoint_slots_of_every_expert(ep):
    d = moe_dims()
    seen: dict[str, tuple[int, str]] = {}
    for rank in range(ep):
        maps = param_maps(d, pp_size=1, pp_rank=0, te_fused_norms=False, ep_size=ep, ep_rank=rank)
        experts = [pm for pm in maps if pm.expert is not None]
        assert len(experts) == 2 * d.num_layers * d.num_experts // ep  # fc1 + fc2 per local expert
        for pm in experts:
            local = int(pm.megatron_name.split("local_experts.")[1].split(".")[0])
            assert pm.expert == rank * (d.num_experts // ep) + local
            assert f".experts.{pm.expert}." in pm.hf_names[0]
            for name in pm.hf_names:
                assert name not in seen, (name, seen.get(name), rank)
                seen[name] = (rank, pm.megatron_name)
            # the sender names what EP rank r holds in this slot from its own map
            for r in range(ep):
                peer = ep_peer(pm, d, ep, r)
                twin = next(
                    p
                    for p in param_maps(d, pp_size=1, pp_rank=0, te_fused_norms=False, ep_size=ep, ep_rank=r)
                    if p.megatron_name == pm.megatron_name
                )
                assert peer == twin
    all_experts = {
        n
        for pm in param_maps(d, pp_size=1, pp_rank=0, te_fused_norms=False)
        for n in pm.hf_names
        if ".experts." in n
    }
    assert set(seen) == all_experts


def test_expert_tp_shards_merge_to_the_full_expert():
    d = moe_dims()
    state = hf_state(d)
    full = hf_to_megatron_shard(
        state.__getitem__, d, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, ep_size=2, ep_rank=1
    )
    shards = [
        hf_to_megatron_shard(state.__getitem__, d, tp_size=2, tp_rank=0, pp_size=1, pp_rank=0, ep_size=2, ep_rank=1,
                             expert_tp_size=2, expert_tp_rank=r)
        for r in range(2)
    ]  # fmt: skip
    maps = param_maps(d, pp_size=1, pp_rank=0, te_fused_norms=False, ep_size=2, ep_rank=1)
    for pm in (pm for pm in maps if pm.expert is not None):
        assert pm.kind in (Kind.gate_up, Kind.row)
        assert torch.equal(merge_tp(pm, [s[pm.megatron_name] for s in shards]), full[pm.megatron_name])
        assert shards[0][pm.megatron_name].numel() * 2 == full[pm.megatron_name].numel()
    # EP rank 1, slot 0 is expert 2: [gate; up] of that expert
    fc1 = full["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"]
    gate, up = (state[f"model.layers.1.mlp.experts.2.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(fc1, torch.cat([gate, up]))
    router = full["decoder.layers.1.mlp.router.weight"]
    assert torch.equal(router, state["model.layers.1.mlp.gate.weight"])


def test_moe_settings_follow_the_hf_router():
    from areal_jobs.trainer.megatron.model import moe_settings

    s = moe_settings(moe_dims(), ep_size=2, expert_tp_size=1, aux_loss_coef=0.01)
    assert s["num_moe_experts"] == 4 and s["moe_router_topk"] == 2 and s["moe_ffn_hidden_size"] == 24
    assert s["moe_router_pre_softmax"] is False  # norm_topk_prob: softmax over the top k
    assert s["moe_router_dtype"] == "fp32" and s["moe_grouped_gemm"] is False
    assert s["expert_model_parallel_size"] == 2 and s["moe_aux_loss_coeff"] == 0.01
    raw = moe_settings(moe_dims(norm_topk_prob=False), ep_size=1, expert_tp_size=1, aux_loss_coef=0.0)
    assert raw["moe_router_pre_softmax"] is True  # softmax over all experts, then the top k
    assert moe_settings(ModelDims.from_hf_config({**moe_config(), "model_type": "qwen3"}), ep_size=1,
                        expert_tp_size=1, aux_loss_coef=0.0) == {}  # fmt: skip


def test_router_aux_weighting_and_scale():
    from areal_jobs.trainer.megatron import router_aux

    d = moe_dims()
    assert router_aux.resolve_router_coef(d, None) == 0.01 and router_aux.resolve_router_coef(d, 0.0) == 0.0
    dense = ModelDims.from_hf_config({**moe_config(), "model_type": "qwen3"})
    assert router_aux.resolve_router_coef(dense, None) == 0.0
    with pytest.raises(ValueError, match=r"trainer\.router_aux_loss_coef=0\.1: the model is dense"):
        router_aux.resolve_router_coef(dense, 0.1)
    # micro-batches of 30 and 10 tokens, each loss scaled by its token count: weights 3/4 and 1/4
    coef = router_aux.per_token_coef(0.01, 40)
    assert [coef * n for n in (30, 10)] == pytest.approx([0.0075, 0.0025])
    # balanced routing: Megatron's per-layer loss is 1 per layer and micro-batch; TP 2 duplicates
    total = 1.0 * d.num_layers * 3 * 2 * 2  # layers x micro-batches x DP x TP
    assert router_aux.logged_value(total, d, tp_size=2, dp_size=2, microbatches=3) == pytest.approx(
        d.moe_topk
    )


def test_an_expert_grid_that_does_not_fold_onto_the_ranks_is_refused_before_any_group():
    """TrainerConfig checks ETP x EP | TP x DP once dp_size > 1 (the planner derives it); the
    trainer's start checks it whatever dp_size says, before touching the process group."""
    from areal_jobs.config import TrainerBackend, TrainerConfig
    from areal_jobs.trainer.megatron.dist import init_distributed

    cfg = TrainerConfig(backend=TrainerBackend.megatron, ep_size=2)  # dp_size 1: one rank
    with pytest.raises(ValueError, match=r"trainer\.ep_size=2 .*set trainer\.dp_size=2"):
        init_distributed(cfg)
