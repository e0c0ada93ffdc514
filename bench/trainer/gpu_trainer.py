"""The trainer on one GPU, in peers' units: `python -m bench.trainer.gpu_trainer` (`make bench-gpu`).

Measures one training step of one packed micro-batch (random weights, no download) for the torch
backend and Megatron (1 rank) at `model.shape=qwen2_1p5b` in bf16, at 32,768 / 16,384 / 8,192
tokens of sequences of 64 to 16,384 tokens (log-normal around 3,000), for each recompute mode the
planner says fits the device, "before" (the torch chunked head and per-sequence SDPA) beside
"after" (the Triton head with per-sequence SDPA, torch's varlen_attn, compiled FlexAttention, and
at the largest size trainer.compile with the fastest of them). Per point: train tokens/s; MFU
ours, peers' and HFU (bench/trainer/gpu_trainer_report.py); peak allocated and reserved memory beside the
planner's prediction (launch/planning/fit/memory.py), measured / predicted. Writes gpu_trainer.json
and gpu_trainer.md into --out (default bench/) and prints the table.

Sized for 8 minutes on one H100/H200, start-up and first compiles included (--budget-s, default
480): the points' time is estimated first and the bench refuses to start (exit 2) when it would
not fit; while it runs each backend's process skips the points its deadline cannot hold, and what
ran is written. One process per backend (bench/trainer/gpu_trainer_point.py) builds the model once;
points switch the head, attention, recompute and compile in place.

The MoE (issue 44): `--shape qwen3_30b_a3b --layers 4`, Qwen3-30B-A3B's first 4 layers (3.1B
parameters, 0.85B active: what one 80 GB GPU trains with Adam; bench/trainer/gpu_trainer_plan.py
says why 4), a random Qwen3MoeForCausalLM; Megatron with its MoE layers (1 rank: TP = EP = 1),
FLOPs over the experts each token goes through (gpu_trainer_report.py). `--layers N` cuts any shape.

`--sizes` and `--no-compile` trim the plan (bench/README.md: the two prepared device commands).

`--smoke` runs the same code on CPU: a 2-layer Qwen2 of width 64 (for an MoE shape a 2-layer
Qwen3-MoE of 4 experts of width 32, top-2) and a 512-token vocabulary in float32, at 512 and 256
tokens, the Triton head through Triton's interpreter; the CUDA-only attention kernels are refused
by name, and trainer.compile is left to its unit test. Without CUDA
and without --smoke it exits 2. Megatron needs megatron-core: where it is not importable, its
points are skipped with a line saying so (bench/README.md: carrying the wheel to the GPU machine).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.trainer import gpu_trainer_report as report
from bench.trainer.gpu_trainer_plan import (  # noqa: F401 - GPU_SIZES, BEFORE, AFTER: the tests' names
    AFTER,
    ASSUMED_HFU,
    ASSUMED_HFU_MOE,
    BEFORE,
    GPU_COSTS_S,
    GPU_SIZES,
    TIMED_STEPS,
    bench_config,
    costs,
    estimate,
    plan,
)
from launch.planning.fit.memory_plan import USABLE_SHARE
from launch.planning.fit.model_shape import NAMED_SHAPES, shape_from_hf_config

REPO = Path(__file__).resolve().parents[2]


def gpu_name_and_memory() -> tuple[str, int] | None:
    """From nvidia-smi (no CUDA context in this process), else None."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout  # fmt: skip
    except (subprocess.SubprocessError, OSError):
        return None
    name, mib = out.splitlines()[0].rsplit(",", 1)
    return name.strip(), int(float(mib)) << 20


def megatron_importable() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def run_child(spec: dict, workdir: Path, prepare: Path | None, env: dict, kill_at: float) -> list[dict]:
    """One bench/trainer/gpu_trainer_point.py process: the JSON lines it printed (up to a kill at `kill_at`)."""
    path = workdir / f"spec-{spec['backend']}.json"
    path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "bench.trainer.gpu_trainer_point", "--spec", str(path)]
    cmd += ["--prepare", str(prepare)] if prepare else []
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=max(1.0, kill_at - time.time()))
    except subprocess.TimeoutExpired:
        print(f"[gpu_trainer] {spec['backend']}: past the budget, stopped", file=sys.stderr)
        proc.kill()
        proc.wait(timeout=30)
    reader.join(timeout=10)
    if proc.returncode not in (0, -9):
        print(f"[gpu_trainer] {spec['backend']}: exit {proc.returncode}", file=sys.stderr)
    return [
        json.loads(line.split(" ", 1)[1])
        for line in lines
        if line.split(" ", 1)[0] in ("POINT", "SKIP", "DEVICE")
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.trainer.gpu_trainer", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--smoke", action="store_true", help="the same code on CPU at a tiny shape")
    parser.add_argument("--budget-s", type=float, help="wall-clock budget (default 480; smoke 170)")
    parser.add_argument(
        "--out", type=Path, help="where gpu_trainer.json/.md go (default bench/; smoke runs/bench/)"
    )
    parser.add_argument("--backends", default="megatron,torch")
    parser.add_argument("--shape", default="qwen2_1p5b", choices=sorted(NAMED_SHAPES))
    parser.add_argument(
        "--layers", type=int, help="only the shape's first N decoder layers (the MoE on one GPU: 4)"
    )
    parser.add_argument(
        "--sizes",
        type=lambda v: tuple(sorted((int(t) for t in v.split(",")), reverse=True)),
        help="tokens per micro-batch, comma-separated (default 32768,16384,8192)",
    )
    parser.add_argument("--no-compile", action="store_true", help="leave out the trainer.compile rows")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    start = time.time()
    budget = args.budget_s or (170.0 if args.smoke else 480.0)
    out_dir = args.out or (REPO / "runs" / "bench" if args.smoke else REPO / "bench")
    try:
        config, source = bench_config(args.shape, args.layers, args.smoke)
    except ValueError as exc:
        print(f"bench.trainer.gpu_trainer: {exc}", file=sys.stderr)
        return 2
    shape = shape_from_hf_config(config, source)
    notes, backends = [], [b for b in args.backends.split(",") if b]
    if "megatron" in backends and not megatron_importable():
        backends.remove("megatron")
        notes.append(
            "megatron: skipped, megatron-core is not importable here (bench/README.md: carry its wheel)"
        )
        print(f"[gpu_trainer] {notes[-1]}", file=sys.stderr)
    gpu = None if args.smoke else gpu_name_and_memory()
    if not args.smoke and gpu is None:
        print(
            "bench.trainer.gpu_trainer: no CUDA device (nvidia-smi): run it on a GPU, or --smoke on CPU",
            file=sys.stderr,
        )
        return 2
    peak = report.peak_flops(gpu[0]) if gpu else None
    torch_version = importlib.metadata.version("torch")
    kv_repeat = tuple(int(v) for v in torch_version.split("+")[0].split(".")[:2]) < (2, 12)
    usable = int(gpu[1] * USABLE_SHARE) if gpu else 0
    points, not_planned = plan(args, shape, usable, backends, kv_repeat)
    seconds = estimate(points, shape, peak, args.smoke)
    fixed = costs(shape, args.smoke)
    needed = fixed["prepare"] + fixed["process"] * len(backends) + sum(seconds)
    if needed > budget:
        print(
            f"bench.trainer.gpu_trainer: {len(points)} points need ~{needed:.0f} s by the time model "
            f"(ASSUMED_HFU={ASSUMED_HFU_MOE if shape.is_moe else ASSUMED_HFU}, {fixed}), over the {budget:.0f} s budget: pass --budget-s "
            f"{needed:.0f} or fewer backends (--backends)", file=sys.stderr,
        )  # fmt: skip
        return 2
    for p, s in zip(points, seconds, strict=True):
        p["estimate_s"] = s
    print(f"[gpu_trainer] {len(points)} points, ~{needed:.0f} s of a {budget:.0f} s budget", file=sys.stderr)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    if args.smoke:  # the Triton head through the interpreter; RSS that follows the live tensors
        env.update(TRITON_INTERPRET="1", MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    base = {
        "config": config,
        "dtype": "float32" if args.smoke else "bfloat16",
        "threads": 1,
        "timed_steps": TIMED_STEPS,
    }
    rows: list[dict] = []
    device = {"name": gpu[0] if gpu else "cpu", "torch": torch_version, "triton": "?"}
    with tempfile.TemporaryDirectory(prefix="gpu_trainer_") as tmp:
        workdir = Path(tmp)
        model_dir = workdir / "model"
        prepared = run_child(
            {**base, "backend": "prepare", "points": []}, workdir, model_dir, env, start + budget
        )
        device.update(prepared[0] if prepared else {})
        for i, backend in enumerate(backends):
            mine = [p for p in points if p["backend"] == backend]
            if not mine:
                continue
            # this backend's share of what is left: its estimate over the estimates still to run
            share = sum(p["estimate_s"] for p in mine) + fixed["process"]
            left = sum(p["estimate_s"] for p in points if p["backend"] in backends[i:])
            left += fixed["process"] * (len(backends) - i)
            deadline = time.time() + (start + budget - time.time()) * share / left
            spec = {
                **base,
                "backend": backend,
                "model_dir": str(model_dir),
                "points": mine,
                "deadline": deadline,
            }
            # a point in flight past its deadline gets a minute, within the budget's last 20 s
            got = run_child(spec, workdir, None, env, min(deadline + 60, start + budget + 20))
            seen = {r["name"] for r in got}
            rows += got + [
                {**p, "status": "skipped: the process ended first"} for p in mine if p["name"] not in seen
            ]
            write(out_dir, args, shape, device, peak, rows + not_planned, notes, start, budget, kv_repeat)
    result = write(out_dir, args, shape, device, peak, rows + not_planned, notes, start, budget, kv_repeat)
    print(report.markdown(result))
    return 0 if any(r["status"] == "ok" for r in rows) else 1


def write(out_dir, args, shape, device, peak, rows, notes, start, budget, kv_repeat) -> dict:
    """Every row completed with its FLOPs, utilisation and predictions; the JSON and markdown."""
    on_gpu = not args.smoke
    points = []
    for r in rows:
        r = {k: v for k, v in r.items() if k != "estimate_s"}
        estimate_ = report.predict(shape, r, 4 if args.smoke else 2, on_gpu, kv_repeat)
        r.update(
            predicted_allocated_bytes=estimate_.allocated_bytes, predicted_reserved_bytes=estimate_.reserved_bytes,
            predicted_total_bytes=estimate_.total_bytes, scored_tokens=report.scored_tokens(r["lengths"]),
            num_sequences=len(r["lengths"]), longest=max(r["lengths"]),
        )  # fmt: skip
        if r.get("status") == "ok":
            r["tokens_per_s"] = r["tokens"] / r["step_s"]
            r.update(report.utilisation(report.point_flops(shape, r), r["step_s"], peak))
        points.append(r)
    result = {
        "command": " ".join(["python -m bench.trainer.gpu_trainer", *args.argv]),
        "shape": shape.source, "dtype": "float32" if args.smoke else "bfloat16",
        "device": {**device, "peak_tflops": peak / 1e12 if peak else None},
        "budget_s": budget, "wall_s": time.time() - start, "points": points, "notes": notes,
        "fit": report.fit_overheads(points) if on_gpu else {},
    }  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_trainer.json").write_text(json.dumps(result, indent=1))
    (out_dir / "gpu_trainer.md").write_text(report.markdown(result) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(main())
