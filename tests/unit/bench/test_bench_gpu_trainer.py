"""bench/trainer/gpu_trainer.py's logic on CPU: the FLOPs in three units (the peers' formula against
prime-rl's published figures), the batch shape, the points the planner lets run, the time model
and the budget refusal, the table and the memory refit. The bench itself runs in
tests/integration/bench/test_gpu_trainer_smoke.py (--smoke) and on a lent GPU (bench/README.md)."""

from __future__ import annotations

import argparse

import pytest

from bench.trainer import gpu_trainer
from bench.trainer import gpu_trainer_report as report
from launch.planning.fit.model_shape import NAMED_SHAPES, shape_from_hf_config

QWEN3_0P6B = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
              "tie_word_embeddings": True}  # fmt: skip
H100_MEMORY = 81559 << 20  # nvidia-smi's memory.total of an H100 80GB HBM3


def flops_of(shape, lengths, scored, recompute="none"):
    return report.step_flops(
        layers=shape.num_layers, hidden=shape.hidden_size, heads=shape.num_heads, kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, ffn=shape.intermediate_size, vocab=shape.vocab_size,
        num_params=shape.num_params(), lengths=lengths, scored=scored, recompute=recompute,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("packed", "tokens_per_s", "published"), [(16384, 11896, 0.1108), (65536, 10147, 0.2680)]
)
def test_peers_formula_reproduces_prime_rl(packed, tokens_per_s, published):
    """prime-rl's trainer benchmark, Qwen3-0.6B on one H100: its tokens/s give its MFU."""
    shape = shape_from_hf_config(QWEN3_0P6B, "qwen3-0.6b")
    assert shape.num_params() == 596_049_920
    step = flops_of(shape, [packed], packed)
    step_s = packed / tokens_per_s
    got = report.utilisation(step, step_s, report.peak_flops("NVIDIA H100 80GB HBM3"))["mfu_peers"]
    assert got == pytest.approx(published, abs=5e-4)


def test_our_flops_and_hardware_flops_by_hand():
    """One layer of H 8, q 8 (2 heads of 4), kv 4, F 16, V 100: matmul parameters 8 x 16 + 8 x 8 +
    3 x 8 x 16 = 576. Sequences of 3 and 5 tokens, 6 scored."""
    shape = shape_from_hf_config({"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16,
                                  "vocab_size": 100}, "small")  # fmt: skip
    layer, attention, head = 2 * 576 * 8, 2 * 8 * (9 + 25), 2 * 100 * 8 * 6
    got = {mode: flops_of(shape, [3, 5], 6, mode) for mode in ("none", "selective", "full")}
    assert got["none"]["ours"] == 3 * (layer + attention + head)
    assert got["none"]["peers"] == (6 * shape.num_params() + 12 * 8 * 8) * 8
    assert got["none"]["hardware"] == got["none"]["ours"] + head  # the chunked head's recomputed logits
    assert got["selective"]["hardware"] == got["none"]["ours"] + head + attention
    assert got["full"]["hardware"] == got["none"]["ours"] + head + layer + attention
    assert report.utilisation(got["none"], 1.0, None) == {"mfu_ours": None, "mfu_peers": None, "hfu": None}


def test_peak_table_by_device_name():
    assert report.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert report.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert report.peak_flops("NVIDIA H200") == report.peak_flops("NVIDIA H800") == 989e12
    assert report.peak_flops("cpu") is None


@pytest.mark.parametrize("tokens", [256, 512, 8192, 16384, 32768])
def test_sequence_lengths_fill_the_row_exactly(tokens):
    for seed in range(20):
        lengths = report.sequence_lengths(tokens, seed)
        assert sum(lengths) == tokens and min(lengths) >= 64 and max(lengths) <= min(16384, tokens)
        assert all(1 <= report.prompt_tokens(n) < n for n in lengths)
    assert report.sequence_lengths(32768, 3) == report.sequence_lengths(32768, 3)


def gpu_plan():
    shape = shape_from_hf_config(NAMED_SHAPES["qwen2_1p5b"], "model.shape=qwen2_1p5b")
    usable = int(H100_MEMORY * gpu_trainer.USABLE_SHARE)
    return shape, *gpu_trainer.plan(
        argparse.Namespace(smoke=False), shape, usable, ["megatron", "torch"], True
    )


def test_the_planner_decides_which_recompute_modes_run():
    """On an 80 GB H100 (76 GiB usable) the 1.5B model keeps every activation only at 8k
    (Megatron, DP 1: its Adam state is not sharded) and 8k-16k (torch); full recompute fits all."""
    shape, points, not_planned = gpu_plan()
    modes = {(p["backend"], p["recompute"], p["tokens"]) for p in points}
    for backend in ("megatron", "torch"):
        assert {(backend, "full", t) for t in gpu_trainer.GPU_SIZES} <= modes
    assert {t for b, m, t in modes if (b, m) == ("megatron", "none")} == {8192}
    assert {t for b, m, t in modes if (b, m) == ("megatron", "selective")} == {8192}
    assert {t for b, m, t in modes if (b, m) == ("torch", "none")} == {8192, 16384}
    assert all(r["status"].startswith("not planned: predicted") for r in not_planned)
    assert ("megatron", "none", 32768) in {(r["backend"], r["recompute"], r["tokens"]) for r in not_planned}
    # the goal row's variants first, before and after; compile last, on the fastest attention
    first = [(p["head"], p["attention"]) for p in points[:4]]
    assert first == [gpu_trainer.BEFORE, *gpu_trainer.AFTER] and points[0]["tokens"] == 32768
    mine = [p for p in points if p["backend"] == "torch"]
    assert mine[-1]["compile"] and mine[-1]["attention"] == "best" and sum(p["compile"] for p in mine) == 1


def test_the_default_plan_fits_its_budget_and_flex_compiles_once_per_process():
    shape, points, _ = gpu_plan()
    seconds = gpu_trainer.estimate(points, shape, 989e12, smoke=False)
    costs = gpu_trainer.GPU_COSTS_S
    total = costs["prepare"] + 2 * costs["process"] + sum(seconds)
    assert total <= 480, total
    flex = [(p["backend"], p["tokens"], s) for p, s in zip(points, seconds) if p["attention"] == "flex"]
    megatron_32k, torch_32k = (s for b, t, s in flex if t == 32768)
    assert megatron_32k - torch_32k == pytest.approx(costs["flex"] - costs["flex_cached"], abs=1e-6)


def test_over_budget_or_without_a_gpu_it_refuses_to_start(tmp_path, monkeypatch, capsys):
    assert gpu_trainer.main(["--smoke", "--budget-s", "10", "--out", str(tmp_path)]) == 2
    assert "--budget-s" in capsys.readouterr().err and not list(tmp_path.iterdir())
    monkeypatch.setattr(gpu_trainer, "gpu_name_and_memory", lambda: None)
    assert gpu_trainer.main(["--out", str(tmp_path)]) == 2
    assert "--smoke" in capsys.readouterr().err


def test_table_and_refit_from_rows():
    rows = [
        {"backend": "megatron", "tokens": 32768, "recompute": "full", "head": h, "attention": a, "compile": False,
         "status": "ok", "tokens_per_s": 30000.0, "mfu_ours": 0.3, "mfu_peers": 0.35, "hfu": 0.4,
         "peak_allocated_bytes": alloc, "predicted_allocated_bytes": 10 << 30, "peak_reserved_bytes": int(alloc * 1.1),
         "predicted_reserved_bytes": 10 << 30, "outside_allocator_bytes": 600 << 20}
        for h, a, alloc in (("torch", "varlen", 10 << 30), ("triton", "flex", 11 << 30))
    ]  # fmt: skip
    rows.append(
        {**rows[0], "attention": "varlen_attn", "status": "refused: trainer.attention=varlen_attn is x, y"}
    )
    fit = report.fit_overheads(rows)
    assert fit["reserve_fraction"] == pytest.approx(0.1, rel=1e-6)
    assert fit["runtime_bytes"] == 600 << 20
    assert fit["allocated_above_prediction_bytes/flex"] == 1 << 30
    assert fit["allocated_above_prediction_bytes/varlen"] == 0
    result = {"device": {"name": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6", "peak_tflops": 989.0},
              "shape": "model.shape=qwen2_1p5b", "dtype": "bfloat16", "command": "python -m bench.trainer.gpu_trainer",
              "wall_s": 400.0, "budget_s": 480.0, "points": rows, "fit": fit}  # fmt: skip
    table = report.markdown(result)
    assert (
        "| megatron | 32,768 | full | triton | flex | no | 30,000 | 30.0% | 35.0% | 40.0% | 11.00 |" in table
    )
    assert "| refused: trainer.attention=varlen_attn is x |" in table
    assert "reserve_fraction: 0.100" in table
