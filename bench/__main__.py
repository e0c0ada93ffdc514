"""`make bench`: every benchmark section, side by side in one run, on this machine.

    python -m bench                      # full: at most ~20 minutes on 2 cores
    python -m bench --quick              # smoke version (CI): every section, small sizes
    python -m bench --only e2e,pause     # some sections

Sections (each a module with run(quick) -> dict[str, float] of flat `a/b` metrics):
packing, controller (ceiling + ZeroMQ), weight_sync, pause (abort / in_place / drain),
weight_delta (full copy vs delta by phase on bf16 SGLang and vLLM; bf16 values changed per step),
reward_overhead (rewards on vs off), reward_model (reward-model answers/s per server, batch 16 vs 1),
e2e (async per pause mode vs sync vs colocated sync, 3 interleaved
rounds: medians and spreads, per-step breakdown, load), reward (rewards/s),
sandbox (code rewards/s by sandbox mode: root netns vs unprivileged userns),
trainer (torch vs Megatron tokens/s), trainer_memory (peak memory and tokens/s at 2k-32k tokens
per micro-batch, before/after, beside the planner's memory model), engine (SGLang vs vLLM).
The sections that need an SGLang server share one (2 threads), started once and stopped before
the end-to-end runs start their own processes. Under --quick, engine and weight_delta also share
one bf16 vLLM server (QUICK_SHARED_VLLM), and on a 2-core machine e2e's colocated run uses the
shared SGLang server, then stops it (QUICK_SHARED_SGLANG); the full bench starts one per section.
Writes bench/results.json (metrics, per-section wall time and load average, machine) and prints
one markdown headline table plus a table per section. A failing section is reported, the others
still run, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path

from bench.report import markdown

RESULTS = Path(__file__).resolve().parent / "results.json"
SHARED_SERVER_THREADS = 2  # engine_bench.SERVER_THREADS: its SGLang figures come from this server
LOG_DIR = (
    Path(__file__).resolve().parents[1] / "runs" / "bench" / "logs"
)  # server logs, kept for post-mortems

# (name, module, shares the SGLang server), in running order: pure sections first, the end-to-end
# runs after the shared server is gone, the long reward and trainer benches last. The engine
# comparison measures SGLang on the shared server (one start fewer), then starts vLLM.
SECTIONS: list[tuple[str, str, bool]] = [
    ("packing", "bench.trainer.packing_bench", False),
    ("controller", "bench.rollout.controller_bench", False),
    ("weight_sync", "bench.weights.weight_sync_bench", True),
    ("pause", "bench.rollout.pause_bench", True),
    ("reward_overhead", "bench.reward.reward_overhead_bench", True),
    ("engine", "bench.rollout.engine_bench", True),  # SGLang vs vLLM: vLLM started by the section itself
    # full copy vs delta by phase on bf16 SGLang and vLLM servers (its own, one at a time), and
    # the share of bf16 values changed per step (issue 35)
    ("weight_delta", "bench.weights.weight_delta_bench", False),
    ("e2e", "bench.e2e.e2e_bench", False),
    ("reward", "bench.reward.reward_bench", False),
    # reward-model answers/s per server (reward.model.answers_per_s for the planner), batched vs not
    ("reward_model", "bench.reward.reward_model_bench", False),
    ("sandbox", "bench.reward.sandbox_bench", False),  # code rewards/s: netns (root) vs userns (as nobody)
    ("trainer", "bench.trainer.trainer_bench", False),
    # peak memory and tokens/s per micro-batch size, before/after, beside the memory model (issue 25)
    ("trainer_memory", "bench.trainer.trainer_memory_bench", False),
]


# --quick: the sections that share one bf16 vLLM server (2 threads; weight_delta's own settings),
# started by the first to ask and stopped after the last, instead of one each: a vLLM start is
# 40-100 s of a 2-core CI machine. The full bench keeps one per section (engine's in float32,
# as its SGLang, weight_delta's in bf16).
QUICK_SHARED_VLLM = ("engine", "weight_delta")
# --quick where the shared SGLang server already has every core's threads (CI: 2 cores): e2e's
# colocated run uses it (the server it would start: same model, threads and token budget) and
# stops it before its launch.local runs, instead of starting its own
QUICK_SHARED_SGLANG = ("e2e",)


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def run_sections(names: list[str], quick: bool) -> dict:
    from bench.harness import SharedServer, bench_model, sglang_server

    results: dict = {"quick": quick, "sections": {}, "errors": {}, "timing_s": {}, "load_after": {}}
    results["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_start": _load(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
    }
    t_start = time.monotonic()
    chosen = [s for s in SECTIONS if s[0] in names]
    late_users = QUICK_SHARED_SGLANG if quick and os.cpu_count() == SHARED_SERVER_THREADS else ()
    chosen = [(name, module, shared or name in late_users) for name, module, shared in chosen]
    server_users = [name for name, _, shared in chosen if shared]
    vllm_users = [name for name, _, _ in chosen if quick and name in QUICK_SHARED_VLLM]
    LOG_DIR.mkdir(parents=True, exist_ok=True)

    def start_vllm():  # imported here: a run without these sections loads no trainer stack
        from areal_jobs.config import RolloutEngine
        from bench.weights.weight_delta_bench import start_bf16_server

        return start_bf16_server(RolloutEngine.vllm, bench_model(), LOG_DIR)

    vllm = SharedServer(start_vllm, LOG_DIR / "vllm-bf16.log")
    with contextlib.closing(vllm), contextlib.ExitStack() as stack:  # vllm: closing twice is a no-op
        server = None
        for name, module, shared in chosen:
            if shared and server is None:
                server = stack.enter_context(sglang_server(bench_model(), SHARED_SERVER_THREADS, LOG_DIR))
            t0 = time.monotonic()
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            try:
                mod = importlib.import_module(module)
                kwargs = {"server": server} if shared else {}
                if name in late_users:
                    kwargs["release"] = stack.close  # it frees the cores before its own processes
                if name in vllm_users:
                    kwargs["vllm"] = vllm
                results["sections"][name] = mod.run(quick=quick, **kwargs)
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep what was measured, stop here
                results["errors"][name] = "interrupted"
                break
            except Exception:  # noqa: BLE001 - one broken section must not hide the others
                results["errors"][name] = traceback.format_exc()
                print(results["errors"][name], file=sys.stderr)
            results["timing_s"][name] = round(time.monotonic() - t0, 1)
            results["load_after"][name] = _load()
            print(
                f"[bench] {name}: {results['timing_s'][name]} s, load {results['load_after'][name]}",
                file=sys.stderr,
            )
            if vllm_users and name == vllm_users[-1]:
                vllm.close()
            if shared and name == server_users[-1]:
                stack.close()  # the end-to-end runs start their own processes: free the cores
                server = None
    results["machine"]["load_end"] = _load()
    results["wall_s"] = time.monotonic() - t_start
    return results


def _interrupt(signum, _frame) -> None:
    # SIGTERM (a timeout, a cancelled CI job) unwinds like Ctrl-C, so the servers we started are
    # stopped: they run in their own sessions and would otherwise outlive us
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke version: every section, small sizes")
    parser.add_argument(
        "--only", default="", help="comma-separated sections: " + ",".join(s[0] for s in SECTIONS)
    )
    parser.add_argument("--out", default=str(RESULTS), help="results JSON path")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("AREAL_JOBS_LOG_LEVEL", "WARNING"))
    signal.signal(signal.SIGTERM, _interrupt)
    names = [s[0] for s in SECTIONS] if not args.only else args.only.split(",")
    unknown = set(names) - {s[0] for s in SECTIONS}
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    if args.quick:
        # the smoke runs beside other work (CI: the other test worker): 2-thread servers and
        # trainers whose OpenMP threads spin-wait for a descheduled sibling generated 25-30
        # tokens/s there instead of ~900 (pause section 97 s -> 33 s, a 2-thread server's start
        # 97 s -> 37 s, load 5-10). Set before anything here loads torch; children inherit it.
        # The full bench keeps the OpenMP default unless the caller sets it.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    results = run_sections(names, args.quick)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    text = markdown(results)
    out.with_suffix(".md").write_text(text)
    print(text)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
