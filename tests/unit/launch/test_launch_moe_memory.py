"""The planner's mixtures of experts (issue 44, item 5): Qwen3-MoE shapes from config.json, total vs
active parameters, Megatron's expert parallelism per rank by hand, its validation, the
Qwen3-30B-A3B recipe's plan and its refusals with the overrides that fit."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from areal_jobs.config import (
    AlgoConfig,
    ClusterConfig,
    ClusterKind,
    JobConfig,
    ModelConfig,
    RunConfig,
    TrainerBackend,
    TrainerConfig,
    register_configs,
    to_job_config,
)
from launch.planning.fit.memory import (
    TrainerMemoryInputs,
    layer_activation_bytes,
    moe_mlp_activation_bytes,
    trainer_memory,
)
from launch.planning.fit.memory_plan import USABLE_SHARE, check_memory, memory_plan
from launch.planning.fit.model_shape import ModelShape, named_shape, resolve_shape, shape_from_hf_config
from launch.planning.layout.placement import LayoutError
from launch.planning.layout.plan import apply_plan, plan_job
from launch.slurm.submit import prepare

REPO = Path(__file__).resolve().parents[3]
GIB = 1 << 30

# H 8, 2 layers, both sparse, 2 query heads and 1 KV head of width 4, no biases, q/k norms (Qwen3),
# untied, V 100, 8 experts of width 4, top-2. Attention: q 8x8 + k, v 8x4 each + o 8x8 = 192,
# q/k norms 2 x 4 = 8, two layer norms 2 x 8 = 16: 216. Experts: 8 x 3 x 8 x 4 = 768; router 8 x 8
# = 64. Layer: 216 + 64 + 768 = 1048. Model: embeddings 2 x 800 + 2 x 1048 + final norm 8 = 3704;
# active: 6 unused experts of 96 per layer fewer: 3704 - 2 x 576 = 2552.
TINY_MOE = ModelShape(
    "tiny-moe", 8, 2, 2, 1, 4, 16, 100, False, qkv_bias=False, qk_norm=True,
    num_experts=8, experts_per_token=2, moe_intermediate_size=4, moe_layers=2,
)  # fmt: skip


def qwen3_moe_config(**changes) -> dict:
    """A config.json as Qwen3-MoE checkpoints write it (the keys the planner reads and a few more)."""
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 8,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "intermediate_size": 16, "vocab_size": 100, "tie_word_embeddings": False, "attention_bias": False,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 4, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "rms_norm_eps": 1e-6,
    }  # fmt: skip
    return {**config, **changes}


def test_a_qwen3_moe_config_json_is_read(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(qwen3_moe_config()))
    shape = resolve_shape(JobConfig(model=ModelConfig(path=str(tmp_path), shape="qwen2_7b")))
    assert shape == dataclasses.replace(TINY_MOE, source=str(tmp_path / "config.json"))
    assert shape.is_moe and shape.attention_params == 216 and shape.moe_layer_params == 1048
    assert shape.num_params() == 3704 and shape.active_params() == 2552 and shape.expert_params() == 1536


def test_dense_layers_follow_mlp_only_layers_and_the_sparse_step() -> None:
    # 4 layers, step 2: layers 1 and 3 sparse; layer 3 listed dense only: 1 sparse, 3 dense
    config = qwen3_moe_config(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    shape = shape_from_hf_config(config, "c")
    assert shape.moe_layers == 1 and shape.dense_layers == 3
    dense_layer = 216 + 3 * 8 * 16  # attention + the 16-wide dense SwiGLU MLP
    assert shape.dense_layer_params == dense_layer
    assert shape.num_params() == 1600 + 3 * dense_layer + 1048 + 8
    assert shape.active_params() == shape.num_params() - 576
    # a dense Qwen3 config reads as before: no experts
    dense = shape_from_hf_config({**config, "model_type": "qwen3", "num_experts": 0}, "d")
    assert not dense.is_moe and dense.num_params() == 1600 + 4 * dense_layer + 8


def test_a_moe_config_without_its_expert_keys_is_refused() -> None:
    config = qwen3_moe_config()
    del config["num_experts_per_tok"]
    with pytest.raises(
        ValueError, match="not a decoder config the memory planner reads.*num_experts_per_tok"
    ):
        shape_from_hf_config(config, "broken/config.json")


def test_qwen3_30b_a3b_total_and_active_parameters() -> None:
    shape = named_shape("qwen3_30b_a3b")
    # the model card: 30.5B parameters, 3.3B activated, 29.9B non-embedding
    assert shape.num_params() == 30_532_122_624
    assert shape.active_params() == 3_353_032_704
    assert round(shape.num_params() / 1e9, 1) == 30.5 and round(shape.active_params() / 1e9, 1) == 3.4
    assert round((shape.num_params() - 2 * shape.embedding_params()) / 1e9, 1) == 29.9
    # 48 sparse layers of 128 experts of 3 x 2048 x 768, top-8, a 128 x 2048 router each
    assert shape.moe_layers == 48 and shape.expert_params() == 48 * 128 * 3 * 2048 * 768
    assert shape.router_params == 128 * 2048
    # the KV cache is the attention's: 48 layers x 4 KV heads x 128 x K, V x bf16 = 96 KiB per token
    assert shape.kv_bytes_per_token(2) == 2 * 48 * 4 * 128 * 2


def megatron(ep: int, tp: int = 1, dp: int = 8, **kw) -> TrainerMemoryInputs:
    base = dict(
        backend=TrainerBackend.megatron, param_bytes=2, compute_bytes=2, tp=tp, pp=1, dp=dp, tokens=64,
        scored_tokens=64, recompute="none", attention="varlen", logprob_chunk_tokens=16, on_gpu=False, ep=ep,
    )  # fmt: skip
    return TrainerMemoryInputs(**{**base, **kw})


def parts(estimate) -> dict[str, int]:
    return {name: size for name, size, _ in estimate.parts}


@pytest.mark.parametrize(
    ("ep", "params", "grads"),
    [(1, 7408, 14816), (2, 5872, 11744), (4, 5104, 10208), (8, 4720, 9440)],
)
def test_expert_parallel_rank_by_hand(ep: int, params: int, grads: int) -> None:
    """TP 1 x DP 8, bf16. Dense part 1600 + 2 x 216 + 2 x 64 (router) + 8 = 2168; experts 1536 / EP
    (3704, 2936, 2552, 2360 per rank): x 2 B, float32 grads x 4 B. Adam 12 B/param: the dense part
    over DP 8 (3252), the experts over expert DP 8 / EP: 1536 / EP x 12 / (8 / EP) = 2304 at every EP."""
    got = parts(trainer_memory(TINY_MOE, megatron(ep)))
    assert (got["parameters"], got["gradients"], got["optimizer"]) == (params, grads, 3252 + 2304)


def test_tp_splits_the_dense_part_but_not_the_router() -> None:
    """TP 2 x DP 4, EP 4: dense (1600 + 432) / 2 + 128 + 8 = 1152, experts 1536 / 4 = 384; Adam
    1152 x 12 / 4 + 384 x 12 / (expert DP 2 x 4 / 4 = 2) = 3456 + 2304."""
    x = megatron(4, tp=2, dp=4)
    assert x.edp == 2
    got = parts(trainer_memory(TINY_MOE, x))
    assert (got["parameters"], got["optimizer"]) == ((1152 + 384) * 2, 3456 + 2304)
    # FSDP2 and torch hold every expert
    fsdp = dataclasses.replace(x, backend=TrainerBackend.fsdp, tp=1, ep=1)
    assert parts(trainer_memory(TINY_MOE, fsdp))["parameters"] == 3704 * 2 // 4
    torch_rank = dataclasses.replace(fsdp, backend=TrainerBackend.torch, dp=1)
    assert parts(trainer_memory(TINY_MOE, torch_rank))["parameters"] == 3704 * 2


def test_moe_activations_count_the_routed_experts_by_hand() -> None:
    """Megatron bf16: 2 x (5 x 2 x 4 + 2 x 2 x 8) + 8 x 8 = 208 bytes per token per sparse layer in
    place of the dense MLP's 2 x 5 x 16; HF float32: 4 x (4 x 2 x 4 + 2 x 2 x 8) + (4 + 4) x 8 = 320
    in place of 4 x 4 x 16."""
    dense_twin = dataclasses.replace(TINY_MOE, num_experts=0, moe_layers=0)
    x = megatron(2)
    assert moe_mlp_activation_bytes(TINY_MOE, x) == 208
    moe, dense = layer_activation_bytes(TINY_MOE, x), layer_activation_bytes(dense_twin, x)
    assert moe["rest"] - dense["rest"] == 208 - 2 * 5 * 16 and moe["core"] == dense["core"]
    hf = dataclasses.replace(x, backend=TrainerBackend.torch, param_bytes=4, compute_bytes=4, dp=1, ep=1)
    assert moe_mlp_activation_bytes(TINY_MOE, hf) == 320
    moe, dense = layer_activation_bytes(TINY_MOE, hf), layer_activation_bytes(dense_twin, hf)
    assert moe["rest"] - dense["rest"] == 320 - 4 * 4 * 16


def test_expert_parallelism_is_validated_naming_the_override() -> None:
    with pytest.raises(ValueError, match="trainer.ep_size=2 .* use trainer=megatron"):
        TrainerConfig(ep_size=2)
    with pytest.raises(ValueError, match="trainer.ep_size=3 x trainer.expert_tp_size=1 must divide"):
        TrainerConfig(backend=TrainerBackend.megatron, tp_size=2, dp_size=4, ep_size=3)
    with pytest.raises(ValueError, match="trainer.ep_size and trainer.expert_tp_size must be >= 1"):
        TrainerConfig(backend=TrainerBackend.megatron, ep_size=0)
    TrainerConfig(backend=TrainerBackend.megatron, tp_size=4, dp_size=2, ep_size=8)  # EP over TP x DP


def moe_job(nodes: int = 2, fraction: str = "0.5", **trainer) -> JobConfig:
    """Qwen3-30B-A3B's shape on H800 nodes, trainer TP 4 with EP 8 (the recipe's)."""
    fields = dict(backend=TrainerBackend.megatron, tp_size=4, ep_size=8, max_tokens_per_microbatch=32768)
    return JobConfig(
        run=RunConfig(name="moe", root="runs"),
        model=ModelConfig(path="/nowhere", shape="qwen3_30b_a3b"),
        algo=AlgoConfig(batch_size=64, group_size=8),
        trainer=TrainerConfig(**{**fields, **trainer}),
        cluster=ClusterConfig(
            kind=ClusterKind.slurm, nodes=nodes, rollout_fraction=fraction, workdir="/w", python="python"
        ),
    )


def test_the_planner_checks_ep_against_its_dp_and_the_experts() -> None:
    # 1 trainer node of 8 GPUs: TP 4 x DP 2 = 8 ranks cannot hold an expert grid of EP 16
    with pytest.raises(
        LayoutError, match="trainer.ep_size=16 x trainer.expert_tp_size=1 must divide TP 4 x DP 2"
    ):
        plan_job(moe_job(ep_size=16))
    job = moe_job(nodes=4, ep_size=16)  # 2 trainer nodes: TP 4 x DP 4 = 16
    plan = plan_job(job)
    assert plan.trainer_ep == 16 and plan.describe().endswith("TP 4 x PP 1 x DP 4, EP 16)")
    bad = moe_job(nodes=4, ep_size=12, tp_size=1)  # 16 trainer ranks: EP 12 does not fold onto them
    with pytest.raises(LayoutError, match="trainer.ep_size=12"):
        plan_job(bad)
    three = moe_job(nodes=4, ep_size=3, tp_size=1, dp_size=1)
    three = dataclasses.replace(three, cluster=dataclasses.replace(three.cluster, rollout_fraction="0.25"))
    planned = apply_plan(three, plan_job(three))  # 3 trainer nodes: 24 ranks, EP 3 folds onto them
    with pytest.raises(
        ValueError, match=r"trainer.ep_size=3 must divide the model's 128 experts.*\[1, 2, 4, 8"
    ):
        memory_plan(planned, plan_job(three))
    dense = dataclasses.replace(
        moe_job(), model=ModelConfig(path="/nowhere", shape="qwen2_7b"), trainer=TrainerConfig(
            backend=TrainerBackend.megatron, tp_size=4, ep_size=2)
    )  # fmt: skip
    with pytest.raises(ValueError, match="is a dense model: set trainer.ep_size=1"):
        memory_plan(apply_plan(dense, plan_job(dense)), plan_job(dense))


def compose_recipe(*overrides: str) -> JobConfig:
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="submit", overrides=["experiment=moe_qwen3_30b_a3b", *overrides])
    return to_job_config(cfg)


def test_the_30b_a3b_recipe_fits_with_ep_8() -> None:
    prepared = prepare(compose_recipe(), cwd="/shared/areal_jobs", python="python")
    assert prepared.plan.describe() == (
        "16 nodes x 8 GPUs = 12 rollout nodes (96 GPUs, 48 servers of TP 2) + 4 trainer nodes "
        "(32 GPUs, 32 ranks: TP 1 x PP 1 x DP 32, EP 8)"
    )
    memory = prepared.memory
    assert memory.trainer_fits and memory.kv.fits
    text = prepared.memory_text()
    assert text.startswith(
        "trainer memory per rank (megatron TP 1 x PP 1 x DP 32, EP 8, expert DP 4, model.shape=qwen3_30b_a3b "
        "(30.5B params, 3.35B active: 128 experts, top-8)"
    )
    shape = named_shape("qwen3_30b_a3b")
    experts = shape.expert_params() // 8
    dense = 2 * shape.embedding_params(128) + 48 * shape.attention_params + 48 * shape.router_params + 2048
    assert memory.trainer.part("parameters") == (dense + experts) * 2
    assert memory.trainer.part("optimizer") == dense * 12 // 32 + experts * 12 // 4
    # every expert on each server: 30.5B / TP 2 in bf16
    assert memory.kv.weights_bytes_per_gpu == shape.num_params() * 2 // 2
    assert "EP 8" in prepared.script.split("\n# Command:")[0]  # the script's plan line


def named_overrides(text: str) -> list[str]:
    return text.split("fits with ", 1)[1].split("\n", 1)[0].split(" or ")


def test_ep_1_is_refused_with_the_overrides_that_fit() -> None:
    with pytest.raises(ValueError) as err:
        prepare(compose_recipe("trainer.ep_size=1"), cwd="/shared/areal_jobs", python="python")
    text = str(err.value)
    assert (
        "a trainer rank needs" in text
        and "DOES NOT FIT" in text
        and "1.54B dense + 29B expert (EP 1)" in text
    )
    named = named_overrides(text)
    assert "trainer.ep_size=8" in named  # the smallest EP that fits at TP 1 (the recipe's)
    assert not any(o.startswith("trainer.tp_size") for o in named)  # an MoE trains at TP 1
    for override in named:
        prepared = prepare(compose_recipe("trainer.ep_size=1", override), cwd="/w", python="python")
        assert prepared.memory.trainer_fits, override


def test_moe_at_tp_above_1_on_megatron_is_refused_naming_tp_1() -> None:
    """megatron-core's MoE layer needs sequence parallelism with TP > 1, which the trainer does not
    run: refused at submission, before any node is allocated (and again at setup, convert.py)."""
    with pytest.raises(ValueError, match=r"trainer.tp_size=4: a mixture of experts .* at trainer.tp_size=1"):
        prepare(compose_recipe("trainer.tp_size=4"), cwd="/w", python="python")


def test_too_few_trainer_nodes_are_refused_with_the_layouts_that_fit() -> None:
    """15 rollout nodes leave 1 trainer node: TP 4 x DP 2, and the experts' Adam state over expert
    DP 1. The refusal names the split (suggest.py's candidates, each checked by the memory model)."""
    with pytest.raises(ValueError) as err:
        prepare(compose_recipe("cluster.rollout_fraction=0.9375"), cwd="/w", python="python")
    text = str(err.value)
    assert "expert DP 1" in text and "DOES NOT FIT" in text
    layouts = [o for o in named_overrides(text) if o.startswith("cluster.")]
    assert layouts, text
    override = layouts[0].split(" (", 1)[0]
    prepared = prepare(compose_recipe(*override.split()), cwd="/w", python="python")
    assert prepared.memory.trainer_fits and prepared.plan.trainer_nodes >= 2
    # the per-rank total is within the usable share of the GPU
    assert prepared.memory.trainer.total_bytes <= 80 * GIB * USABLE_SHARE


def test_check_memory_without_the_unplanned_job_names_no_layouts() -> None:
    job = compose_recipe("cluster.rollout_fraction=0.9375")
    planned = apply_plan(job, plan_job(job))
    with pytest.raises(ValueError) as err:
        check_memory(planned, plan_job(job))
    assert not any(o.startswith("cluster.") for o in named_overrides(str(err.value)))
