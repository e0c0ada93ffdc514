"""bench/trainer/gpu_trainer.py's mixture of experts on CPU (issue 44): FLOPs over the experts a
token goes through (worked by hand), the dense figures unchanged, the cut shape `--shape
qwen3_30b_a3b --layers 4` and what the planner lets it run on an 80 GB H100 and a 141 GB H200,
and the prepared device commands of bench/README.md inside their budgets on both."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from bench.trainer import gpu_trainer, gpu_trainer_plan
from bench.trainer import gpu_trainer_report as report
from launch.planning.fit.model_shape import NAMED_SHAPES, shape_from_hf_config

REPO = Path(__file__).resolve().parents[3]
GPU_MEMORY = {"H100": 81559 << 20, "H200": 143771 << 20}  # nvidia-smi's memory.total
# 2 layers of H 8, 2 heads of 4 (q 8), 1 KV head (kv 4), dense MLP F 16; layer 1 sparse (layer 0 in
# mlp_only_layers): 4 experts of width 6, top-2
SMALL_MOE = {"model_type": "qwen3_moe", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16, "vocab_size": 100,
             "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 6, "mlp_only_layers": [0]}  # fmt: skip


def point(lengths, recompute="none"):
    return {"lengths": lengths, "recompute": recompute}


def test_moe_flops_by_hand():
    """Attention matmuls 8 x (8 + 2 x 4) + 8 x 8 = 192 per token; the dense layer adds 3 x 8 x 16 =
    384 (576), the sparse one its router 4 x 8 = 32 and 2 experts of 3 x 8 x 6 = 144 (512), not the
    4 experts nor F. Sequences of 3 and 5 tokens (8), 6 scored. Parameters: attention 192 + q/k
    norms 2 x 4 + two RMSNorms 2 x 8 = 216; dense layer 600, sparse 216 + 32 + 4 x 144 = 824;
    untied embeddings 2 x 100 x 8 = 1,600 and the final norm 8: 3,032 in all, 2 unused experts
    fewer (288) active: 2,744."""
    shape = shape_from_hf_config(SMALL_MOE, "small moe")
    assert (shape.num_params(), shape.active_params(), shape.moe_layers) == (3032, 2744, 1)
    layer, attention, head = 2 * (576 + 512) * 8, 2 * 2 * 8 * (9 + 25), 2 * 100 * 8 * 6
    got = {mode: report.point_flops(shape, point([3, 5], mode)) for mode in ("none", "selective", "full")}
    assert got["none"]["ours"] == 3 * (layer + attention + head)
    assert got["none"]["peers"] == (6 * 2744 + 12 * 2 * 8 * 8) * 8 == 144_000
    assert got["selective"]["hardware"] == got["none"]["ours"] + head + attention
    assert got["full"]["hardware"] == got["none"]["ours"] + head + layer + attention


def test_dense_flops_are_what_they_were():
    """A dense shape: every parameter active, no sparse layer: the formula's figures unchanged."""
    shape = shape_from_hf_config(NAMED_SHAPES["qwen2_1p5b"], "model.shape=qwen2_1p5b")
    lengths = report.sequence_lengths(32768, seed=32768)
    dense = report.step_flops(
        layers=28, hidden=1536, heads=12, kv_heads=2, head_dim=128, ffn=8960, vocab=151936,
        num_params=shape.num_params(), lengths=lengths, scored=report.scored_tokens(lengths), recompute="full",
    )  # fmt: skip
    assert report.point_flops(shape, point(lengths, "full")) == dense


def cut_moe():
    config, source = gpu_trainer_plan.bench_config("qwen3_30b_a3b", 4, smoke=False)
    return shape_from_hf_config(config, source)


def test_the_moe_shape_is_qwen3_30b_a3b_cut_to_4_layers():
    shape = cut_moe()
    assert shape.source == "model.shape=qwen3_30b_a3b, its first 4 of 48 layers"
    assert (shape.num_layers, shape.moe_layers, shape.num_experts, shape.experts_per_token) == (4, 4, 128, 8)
    assert shape.num_params() == pytest.approx(3.115e9, rel=1e-3)
    assert shape.active_params() == pytest.approx(0.850e9, rel=1e-3)
    smoke, source = gpu_trainer_plan.bench_config("qwen3_30b_a3b", None, smoke=True)
    assert (smoke["model_type"], smoke["num_experts"], source) == ("qwen3_moe", 4, "smoke (qwen3_moe)")
    with pytest.raises(ValueError, match="pass 1 to 48"):
        gpu_trainer_plan.bench_config("qwen3_30b_a3b", 49, smoke=False)


@pytest.mark.parametrize("gpu", ["H100", "H200"])
def test_the_planner_fits_the_moe_on_one_gpu(gpu):
    """Full recompute at every size, both backends, on an 80 GB H100 too (Megatron 63 GiB at 32k:
    18 B/param over 3.1B parameters); Megatron keeping every activation at 32k only on an H200."""
    usable = int(GPU_MEMORY[gpu] * gpu_trainer.USABLE_SHARE)
    args = argparse.Namespace(smoke=False)
    points, not_planned = gpu_trainer.plan(args, cut_moe(), usable, ["megatron", "torch"], True)
    modes = {(p["backend"], p["recompute"], p["tokens"]) for p in points}
    for backend in ("megatron", "torch"):
        assert {(backend, "full", t) for t in gpu_trainer.GPU_SIZES} <= modes
    missing = {(r["backend"], r["recompute"], r["tokens"]) for r in not_planned}
    assert missing == (
        {("megatron", "none", 32768), ("megatron", "selective", 32768)} if gpu == "H100" else set()
    )


def prepared_commands() -> list[list[str]]:
    """The device commands bench/README.md prepares for a lent GPU: the bench's arguments."""
    text = (REPO / "bench" / "README.md").read_text()
    found = re.findall(r"python3 -m bench\.trainer\.gpu_trainer ([^`\n]*\"\$OUT\"[^`\n]*)", text)
    return [shlex.split(c.replace('"$OUT"', "OUT")) for c in found]


def test_the_prepared_device_commands_fit_their_budgets_on_h100_and_h200():
    """A lent device has 15 minutes in all, 10 per command: the dense and the MoE command together
    within 12.5 minutes of budget, each plan inside its own budget on either device."""
    commands = prepared_commands()
    assert len(commands) == 2 and ["--layers" in c for c in commands] == [False, True]
    assert sum(gpu_trainer.build_parser().parse_args(c).budget_s for c in commands) <= 750
    for argv in commands:
        args = gpu_trainer.build_parser().parse_args(argv)
        config, source = gpu_trainer_plan.bench_config(args.shape, args.layers, smoke=False)
        shape = shape_from_hf_config(config, source)
        for gpu, memory in GPU_MEMORY.items():
            usable = int(memory * gpu_trainer.USABLE_SHARE)
            points, _ = gpu_trainer.plan(args, shape, usable, ["megatron", "torch"], True)
            fixed = gpu_trainer_plan.costs(shape, smoke=False)
            total = (
                fixed["prepare"]
                + 2 * fixed["process"]
                + sum(gpu_trainer.estimate(points, shape, 989e12, False))
            )
            assert total <= args.budget_s <= 600 - 30, (argv, gpu, total)
