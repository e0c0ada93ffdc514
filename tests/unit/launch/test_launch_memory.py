"""The trainer memory model (launch/planning/fit/memory.py): hand-computed small shapes, the named
shapes' parameter counts, the refusal with its fitting overrides, and every committed experiment."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from areal_jobs.config import (
    AlgoConfig,
    Attention,
    ClusterConfig,
    ClusterKind,
    DType,
    JobConfig,
    ModelConfig,
    Placement,
    Recompute,
    RolloutConfig,
    RunConfig,
    TrainerBackend,
    TrainerConfig,
    register_configs,
    to_job_config,
)
from launch.planning.fit.memory import (
    RUNTIME_RESERVE_BYTES,
    GpuOverheads,
    TrainerMemoryInputs,
    trainer_memory,
)
from launch.planning.fit.memory_plan import USABLE_SHARE, check_memory, memory_plan, memory_shares
from launch.planning.fit.model_shape import ModelShape, named_shape, resolve_shape, shape_from_hf_config
from launch.planning.layout.plan import apply_plan, plan_job
from launch.slurm.submit import prepare

REPO = Path(__file__).resolve().parents[3]
GIB = 1 << 30

# H 8, 2 layers, 2 query heads and 1 KV head of width 4, F 16, V 100, tied, q/k/v biases.
# One layer: q 8x8 + k, v 8x4 each + o 8x8 = 192, biases 8 + 4 + 4 = 16, MLP 3 x 8 x 16 = 384,
# norms 2 x 8 = 16: 608. Model: embedding 100 x 8 = 800 (tied) + 2 x 608 + final norm 8 = 2024.
SMALL = ModelShape("test", 8, 2, 2, 1, 4, 16, 100, True)


def inputs(backend: TrainerBackend, **kw) -> TrainerMemoryInputs:
    base = dict(
        backend=backend, param_bytes=4, compute_bytes=4, tp=1, pp=1, dp=1, tokens=64, scored_tokens=48,
        recompute="none", attention="varlen", logprob_chunk_tokens=16, on_gpu=False,
    )  # fmt: skip
    return TrainerMemoryInputs(**{**base, **kw})


def parts(estimate) -> dict[str, int]:
    return {name: size for name, size, _ in estimate.parts}


def test_small_shape_parameter_count() -> None:
    assert SMALL.layer_params == 608
    assert SMALL.num_params() == 2024
    assert SMALL.embedding_params(vocab_multiple=64) == 128 * 8  # 100 padded to 128


def test_torch_backend_small_shape_by_hand() -> None:
    got = parts(trainer_memory(SMALL, inputs(TrainerBackend.torch)))
    assert got["parameters"] == 2024 * 4
    assert got["gradients"] == 2024 * 4
    assert got["optimizer"] == 2024 * 8  # AdamW m, v in float32
    # per layer and token, float32: two HF RMSNorms keep input, normalised and output (2 x 12 x 8 =
    # 192); q, k and v after RoPE (8 + 4 + 4), o_proj input (8) and gate/silu/up/product (4 x 16):
    # 4 x 88 = 352; the core's output (4 x 8) and log-sum-exp (2 heads x 4): 40. 584 per layer,
    # x 2 layers, + the final norm's 12 x 8 and the shared RoPE cos/sin (2 x 4 x 4)
    assert got["activations"] == (2 * 584 + 96 + 32) * 64
    # chunks of 16 of the 48 scored tokens: 2 float32 [16, 100] copies, the head-weight gradient
    # accumulator 100 x 8 x 4 and the gathered hidden rows 48 x 8 x 4
    assert got["log-probs"] == 2 * 16 * 100 * 4 + 100 * 8 * 4 + 48 * 8 * 4
    assert got["attention"] == 0
    assert "runtime" not in got


def test_full_vocabulary_and_dense_paths_by_hand() -> None:
    x = inputs(TrainerBackend.torch, logprob_chunk_tokens=0, attention="dense")
    got = parts(trainer_memory(SMALL, x))
    assert got["log-probs"] == int(3.4 * 48 * 100 * 4) + 48 * 8 * 4  # 3.4 [N, V] float32 copies (fitted)
    assert got["attention"] == 64 * 64 * (1 + 2 * 4)  # bool mask + a float32 mask per layer
    # dense: transformers repeats k and v to both query heads (8 + 8 instead of 4 + 4)
    assert got["activations"] == (2 * (584 + 4 * 8) + 128) * 64


def test_triton_head_keeps_one_chunk_in_the_compute_dtype() -> None:
    x = inputs(TrainerBackend.torch, logprob_kernel="triton")
    # one [16, 100] buffer (the logits, then their gradient, float32 here), the head-weight
    # gradient and the gathered rows; the rest as with the torch head
    assert parts(trainer_memory(SMALL, x))["log-probs"] == 16 * 100 * 4 + 100 * 8 * 4 + 48 * 8 * 4
    bf16 = inputs(TrainerBackend.megatron, param_bytes=2, compute_bytes=2, logprob_kernel="triton")
    assert parts(trainer_memory(SMALL, bf16))["log-probs"] == 16 * 100 * 2 + 100 * 8 * 6 + 48 * 8 * 2


def test_gpu_overheads_are_parts_of_their_own() -> None:
    """On a GPU: the runtime (outside the allocator), and per GpuOverheads the fused attention's
    workspace, inductor's, and the allocator's reserve over everything allocated; the estimate
    splits allocated / reserved / total as torch reports them."""
    base = trainer_memory(SMALL, inputs(TrainerBackend.torch, on_gpu=True))
    assert parts(base)["runtime"] == RUNTIME_RESERVE_BYTES
    assert base.allocated_bytes == base.reserved_bytes == base.total_bytes - RUNTIME_RESERVE_BYTES
    assert {"kernel workspace", "compile workspace", "allocator reserve"}.isdisjoint(parts(base))
    o = GpuOverheads(runtime_bytes=1000, reserve_fraction=0.1, compile_workspace_bytes=500)
    x = inputs(TrainerBackend.torch, on_gpu=True, attention="flex", compile=True, overheads=o)
    got = trainer_memory(SMALL, x)
    assert parts(got)["kernel workspace"] == 64 * 8 * 4  # T x q float32
    assert parts(got)["compile workspace"] == 500
    assert parts(got)["allocator reserve"] == int(got.allocated_bytes * 0.1)
    assert got.reserved_bytes == got.allocated_bytes + parts(got)["allocator reserve"]
    assert got.total_bytes == got.reserved_bytes + 1000
    assert parts(got)["attention"] == 0  # no [T, T] tensor
    # varlen_attn before torch 2.12 repeats K and V to both query heads and keeps them: as dense
    repeat = parts(
        trainer_memory(SMALL, inputs(TrainerBackend.torch, attention="varlen_attn", kv_repeat=True))
    )
    dense = parts(trainer_memory(SMALL, inputs(TrainerBackend.torch, attention="dense")))
    assert repeat["activations"] == dense["activations"]


def test_recompute_full_keeps_layer_inputs_and_one_layer() -> None:
    full = parts(trainer_memory(SMALL, inputs(TrainerBackend.torch, recompute="full")))
    assert full["activations"] == (2 * 8 * 4 + 584 + 128) * 64


def test_megatron_bf16_tp2_dp4_by_hand() -> None:
    x = inputs(TrainerBackend.megatron, param_bytes=2, compute_bytes=2, tp=2, dp=4, vocab_multiple=64)
    got = parts(trainer_memory(SMALL, x))
    params = (128 * 8 + 2 * 608) // 2 + 8  # padded tied embedding and the layers over TP, norm whole
    assert params == 1128
    assert got["parameters"] == params * 2
    assert got["gradients"] == params * 4  # float32 grad buffer
    assert got["optimizer"] == params * 12 // 4  # main params + m + v, sharded over DP 4
    # per layer: e (6H + qkv buffer (q + 2kv) + roped q, k (q + kv) + RoPE cos/sin (4 x 4) + proj
    # input q + 5F/tp) + 8 rstd bytes, with q = 4, kv = 2 per TP rank: 2 x 122 + 8 = 252; core:
    # 2 x 4 + 4 x 2 / 2 = 12; the final norm 3 x 8 x 2
    assert got["activations"] == (2 * (252 + 12) + 48) * 64
    # [16, 64] float32 x 2, the head gradient (float32 + bf16) and the gathered bf16 rows
    assert got["log-probs"] == 2 * 16 * 64 * 4 + 64 * 8 * 6 + 48 * 8 * 2


def test_fsdp_shards_params_grads_and_optimizer_and_gathers_units() -> None:
    got = parts(trainer_memory(SMALL, inputs(TrainerBackend.fsdp, dp=4)))
    assert got["parameters"] == 2024 * 4 // 4
    assert got["gradients"] == 2024 * 4 // 4
    assert got["optimizer"] == 2024 * 8 // 4
    assert got["FSDP2 gather"] == 2 * (800 + 2 * 608) * 4


def test_reference_model_is_a_frozen_copy() -> None:
    with_ref = parts(trainer_memory(SMALL, inputs(TrainerBackend.torch, reference_model=True)))
    assert with_ref["reference model"] == 2024 * 4


def test_named_shapes_match_the_published_parameter_counts() -> None:
    assert named_shape("qwen2_1p5b").num_params() == 1_777_088_000  # R1-Distill-Qwen-1.5B: "1.78B"
    assert round(named_shape("qwen2_7b").num_params() / 1e9, 2) == 7.62
    assert round(named_shape("qwen2_14b").num_params() / 1e9, 1) == 14.8
    assert round(named_shape("qwen2_0p5b").num_params() / 1e6) == 494
    with pytest.raises(ValueError, match="model.shape='qwen9' is not a named shape"):
        named_shape("qwen9")


def test_config_json_wins_over_the_named_shape(tmp_path: Path) -> None:
    config = {"model_type": "qwen2", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 100, "tie_word_embeddings": True}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    job = JobConfig(model=ModelConfig(path=str(tmp_path), shape="qwen2_7b"))
    assert resolve_shape(job) == shape_from_hf_config(config, str(tmp_path / "config.json"))
    assert resolve_shape(JobConfig(model=ModelConfig(path="/nowhere", shape="qwen2_7b"))).num_layers == 28
    assert resolve_shape(JobConfig(model=ModelConfig(path="/nowhere"))) is None


def flagship(**trainer) -> JobConfig:
    """The 1.5B recipe's shape on 2 x 8 H800 (one rollout node, one trainer node: DP 8)."""
    fields = dict(backend=TrainerBackend.megatron, max_tokens_per_microbatch=32768, recompute=Recompute.none)
    return JobConfig(
        run=RunConfig(name="m", root="runs"),
        model=ModelConfig(path="/nowhere", shape="qwen2_1p5b", dtype=DType.bfloat16),
        algo=AlgoConfig(batch_size=64, group_size=8),
        rollout=RolloutConfig(max_new_tokens=16384, max_concurrent=512),
        trainer=TrainerConfig(**{**fields, **trainer}),
        cluster=ClusterConfig(
            kind=ClusterKind.slurm, nodes=2, rollout_fraction="0.5", workdir="/w", python="python"
        ),
    )


def planned(job: JobConfig):
    plan = plan_job(job)
    return apply_plan(job, plan), plan


def test_refusal_names_overrides_that_fit_and_each_one_does() -> None:
    job, plan = planned(flagship())
    with pytest.raises(ValueError) as err:
        check_memory(job, plan)
    text = str(err.value)
    assert "a trainer rank needs" in text and "cluster.gpu_memory_gib=80" in text
    assert "largest part: activations" in text and "DOES NOT FIT" in text
    named = text.split("fits with ", 1)[1].split("\n", 1)[0].split(" or ")
    assert "trainer.recompute=full" in named and "trainer.tp_size=2" in named
    tokens = [o for o in named if o.startswith("trainer.max_tokens_per_microbatch=")]
    assert tokens and int(tokens[0].split("=")[1]) >= 512 + 16384  # still holds the longest sequence
    for override in named:
        key, value = override.removeprefix("trainer.").split("=")
        typed = {"recompute": Recompute, "attention": Attention}.get(key, int)(value)
        fixed, fixed_plan = planned(flagship(**{key: typed}))
        assert memory_plan(fixed, fixed_plan).trainer_fits, override


def with_cluster(job: JobConfig, **changes) -> JobConfig:
    return dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, **changes))


def test_refusal_without_a_single_fix_says_so() -> None:
    job, plan = planned(with_cluster(flagship(), gpu_memory_gib=8))
    with pytest.raises(ValueError, match="no single override fits"):
        check_memory(job, plan)


def test_a_fitting_plan_prints_one_block_with_every_part() -> None:
    job, plan = planned(flagship(recompute=Recompute.full))
    report = check_memory(job, plan)
    text = report.describe()
    assert text.startswith("trainer memory per rank (megatron TP 1 x PP 1 x DP 8, model.shape=qwen2_1p5b")
    for part in ("parameters", "gradients", "optimizer", "activations", "log-probs", "attention", "runtime"):
        assert f"\n  {part}" in text
    assert "rollout KV cache per server (sglang, TP 1" in text
    assert report.trainer.total_bytes <= 80 * GIB * USABLE_SHARE


def test_memory_shares_for_a_colocated_gpu() -> None:
    job, plan = planned(
        with_cluster(flagship(recompute=Recompute.full), nodes=1, placement=Placement.colocated)
    )
    shares = memory_shares(job, plan)
    assert shares.shared_gpu
    # the server's static share is what the trainer rank leaves of the usable memory
    expected = (80 * GIB * USABLE_SHARE - shares.trainer_bytes_per_rank) / (80 * GIB)
    assert shares.server_fraction == pytest.approx(expected)


def committed_experiments() -> list[str]:
    return sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("experiment", committed_experiments())
def test_every_committed_experiment_fits(experiment: str) -> None:
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="submit", overrides=[f"experiment={experiment}"])
    job = to_job_config(cfg)
    if job.cluster.kind is ClusterKind.local:  # a CPU recipe (local_*): nothing to size
        assert experiment in {
            "countdown",
            "local_own_model",
            "local_reward_model",
            "mixture_local",
            "local_moe",
        }
        return
    prepared = prepare(job, cwd="/shared/areal_jobs", python="python")
    assert prepared.memory is not None, "a committed experiment names its model.shape"
    assert prepared.memory.trainer_fits
    assert prepared.memory.kv.fits, prepared.memory.kv.describe()


def test_launch_local_checks_memory_only_where_a_gpu_is_visible(monkeypatch, capsys) -> None:
    from launch.run import preflight

    big = dataclasses.replace(
        flagship(), cluster=ClusterConfig(kind=ClusterKind.local, gpus_per_node=1, gpu_memory_gib=80)
    )
    monkeypatch.setattr(preflight, "gpu_visible", lambda: False)
    preflight.check_local_memory(big)  # CPU: nothing to divide, nothing printed
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(preflight, "gpu_visible", lambda: True)
    with pytest.raises(SystemExit, match="invalid configuration: a trainer rank needs"):
        preflight.check_local_memory(big)
    small = dataclasses.replace(big, trainer=dataclasses.replace(big.trainer, max_tokens_per_microbatch=1024))
    preflight.check_local_memory(small)
    out = capsys.readouterr().out
    assert "trainer memory per rank (megatron TP 1 x PP 1 x DP 1" in out
    assert "less the colocated server's weights" in out  # launch.local's servers share the GPU


def test_auto_fraction_only_weighs_splits_whose_trainer_fits() -> None:
    """4 nodes x 1 GPU: 3 rollout nodes leave DP 1, whose unsharded Adam state (20 GiB for 1.78B
    parameters) does not fit a 40 GiB GPU; on an 80 GiB GPU it does and competes."""
    from launch.planning.layout.allocation import resolve_rollout_fraction

    def job(gpu_gib: float) -> JobConfig:
        return dataclasses.replace(
            flagship(max_tokens_per_microbatch=2048),
            rollout=RolloutConfig(max_new_tokens=1024, max_concurrent=64),
            cluster=ClusterConfig(
                kind=ClusterKind.slurm, nodes=4, gpus_per_node=1, rollout_fraction="auto",
                placement=Placement.nodes, gpu_memory_gib=gpu_gib, workdir="/w", python="python",
            ),
        )  # fmt: skip

    _, small = resolve_rollout_fraction(job(40))
    _, large = resolve_rollout_fraction(job(80))
    assert 3 not in {c.rollout_nodes for c in small.candidates}
    assert 3 in {c.rollout_nodes for c in large.candidates}


def test_lora_trains_the_adapters_only_by_hand() -> None:
    """model.lora.rank=2 on q and v: gradients and AdamW state for the adapters alone, the frozen
    base and the adapters as parameters (SMALL: hidden 8, 2 heads x 4 = q 8, 1 KV head = kv 4)."""
    from areal_jobs.config import LoraConfig

    lora = LoraConfig(rank=2, target_modules=["q_proj", "v_proj"])
    adapters = 2 * ((8 + 8) + (8 + 4)) * 2  # rank x (in + out) per target, 2 layers
    assert adapters == 112
    got = parts(trainer_memory(SMALL, inputs(TrainerBackend.torch, lora=lora)))
    full = parts(trainer_memory(SMALL, inputs(TrainerBackend.torch)))
    assert got["parameters"] == (2024 + adapters) * 4
    assert got["gradients"] == adapters * 4 and got["optimizer"] == adapters * 8
    assert full["gradients"] == 2024 * 4  # full fine-tuning: every parameter


def test_the_plan_takes_auto_as_the_torch_head_and_triton_as_asked() -> None:
    """trainer.logprob_kernel=auto is planned as the torch head (the larger) until a GPU
    measurement confirms the kernel's figure; triton asked for is planned as the kernel."""
    from areal_jobs.config import LogprobKernel

    auto = TrainerMemoryInputs.of(flagship(), tp=1, pp=1, dp=8)
    triton = TrainerMemoryInputs.of(
        flagship(logprob_kernel=LogprobKernel.triton, compile=True), tp=1, pp=1, dp=8
    )
    assert (auto.logprob_kernel, auto.compile) == ("torch", False)
    assert (triton.logprob_kernel, triton.compile) == ("triton", True)
    shape = named_shape("qwen2_1p5b")
    assert parts(trainer_memory(shape, triton))["log-probs"] < parts(trainer_memory(shape, auto))["log-probs"]
