"""`python -m bench.trainer.gpu_trainer --smoke`: the GPU bench's code on CPU (75-115 s on 2 cores; the MoE ~50 s).

One process per backend (the torch backend and Megatron over gloo), a 2-layer Qwen2 of the
shape's kind, float32, at 512 and 256 tokens: each point switches head, attention and recompute on
the built backend, takes a warm-up and two timed steps, and is written to gpu_trainer.json and
gpu_trainer.md. The Triton head runs through Triton's interpreter (TRITON_INTERPRET=1 in the
bench's processes only); the CUDA-only attention kernels are refused by name."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_smoke_runs_every_backend_head_and_recompute_mode(tmp_path):
    proc = subprocess.run(
        # a budget no loaded CI machine reaches: this checks what runs, not how fast (the default
        # 170 s is for a person; ~75-115 s measured on the shared 2-core machine)
        [sys.executable, "-m", "bench.trainer.gpu_trainer", "--smoke", "--budget-s", "1200", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / "gpu_trainer.json").read_text())
    rows = result["points"]
    assert result["device"]["name"] == "cpu" and result["wall_s"] <= result["budget_s"]
    for backend, modes in (("megatron", {"full", "none", "selective"}), ("torch", {"full", "none"})):
        mine = [r for r in rows if r["backend"] == backend]
        assert {r["recompute"] for r in mine if r["status"] == "ok"} == modes, backend
        for head, attention in (("torch", "varlen"), ("triton", "varlen")):
            row = next(
                r
                for r in mine
                if (r["head"], r["attention"], r["tokens"], r["recompute"]) == (head, attention, 512, "full")
            )
            assert row["status"] == "ok", row
            assert row["tokens_per_s"] > 0 and math.isfinite(row["loss"]) and row["peak_allocated_bytes"] > 0
            assert row["predicted_allocated_bytes"] > 0 and row["scored_tokens"] < row["tokens"]
        for kind in ("varlen_attn", "flex"):
            refused = [r for r in mine if r["attention"] == kind]
            assert refused and all(r["status"].startswith("refused") for r in refused), kind
            assert all("set trainer.attention=varlen" in r["status"] for r in refused)
    table = (tmp_path / "gpu_trainer.md").read_text()
    assert "| megatron | 512 | full | triton | varlen | no |" in table and "| torch | 256 | none |" in table


def test_moe_smoke_runs_megatron_moe_layers_in_every_recompute_mode(tmp_path):
    """`--shape qwen3_30b_a3b` on CPU: a 2-layer Qwen3-MoE (4 experts of width 32, top-2), written
    as a random Qwen3MoeForCausalLM and built by Megatron with its MoE layers (1 rank). Megatron
    only (~35 s): its MoE path has the in-place recompute switching, the torch backend runs the
    HF model the dense smoke's code already drives."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.trainer.gpu_trainer", "--smoke", "--shape", "qwen3_30b_a3b",
         "--backends", "megatron", "--budget-s", "1200", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / "gpu_trainer.json").read_text())
    assert result["shape"] == "smoke (qwen3_moe)" and {r["backend"] for r in result["points"]} == {"megatron"}
    ok = [r for r in result["points"] if r["status"] == "ok"]
    assert {r["recompute"] for r in ok} == {"full", "none", "selective"}
    assert {(r["head"], r["tokens"]) for r in ok if r["recompute"] == "full"} >= {
        ("torch", 512),
        ("triton", 512),
    }
    assert all(math.isfinite(r["loss"]) and r["predicted_allocated_bytes"] > 0 for r in ok)
    assert "smoke (qwen3_moe), float32" in (tmp_path / "gpu_trainer.md").read_text()
