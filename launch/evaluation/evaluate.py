"""Evaluate a checkpoint: `make eval CKPT=... DATA=...` (python -m launch.evaluate --ckpt ... --data ...).

Serves the checkpoint on a rollout server (SGLang by default, started exactly as a run starts its
servers), asks every problem n sampled answers and one greedy answer through the training
samples' own generation path, scores them with the training reward functions, and prints

    eval: pass@1=… pass@k=… greedy=… mean_length=… truncation_rate=… problems=… samples=…

It writes OUT/eval.json (summary, pass@k for every k <= n, per-problem rows) and OUT/eval.png.
--ckpt takes an HF directory (a run's final_hf/, the built-in model) or a mid-run checkpoint step
(launch/evaluation/checkpoint.py); --data takes `builtin`, `countdown` (the second built-in task; its
warm start is the default checkpoint then) or a JSONL file (layouts: data/eval_sets.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from areal_jobs.config import DType, ModelConfig, RewardConfig, RolloutConfig, RolloutEngine
from areal_jobs.data.eval_sets import EvalSet, EvalSetSpec, detect_kind, read_eval_set
from areal_jobs.logs import setup_logging
from launch.evaluation.report import build_report, summary_line, write_report

logger = logging.getLogger("launch.evaluate")

BUILTIN_MODEL = "areal_jobs/tasks/models/builtin_model"
COUNTDOWN_MODEL = "areal_jobs/tasks/models/builtin_model_countdown"
GENERATED = {"builtin": EvalSet.builtin, "countdown": EvalSet.countdown}  # --data names of the built-in sets


@dataclass
class EvalArgs:
    ckpt: str = ""  # "": the built-in task's warm start (countdown's for --data countdown)
    data: str = "builtin"  # "builtin", "countdown" or a JSONL path
    kind: EvalSet | None = None  # None: builtin, or detected from the file's first row
    problem_field: str = "problem"
    answer_field: str = "answer"
    limit: int = 0
    samples: int = 8  # n sampled answers per problem
    ks: list[int] = field(default_factory=list)  # empty: 1 and n
    greedy: bool = True
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    out: str = ""  # empty: runs/eval/<checkpoint>-<data>
    engine: RolloutEngine = RolloutEngine.sglang
    dtype: DType = DType.float32
    seed: int = 0
    data_seed: int = 1  # builtin: the run's data.seed
    concurrency: int = 64
    server_threads: int = 1
    max_total_tokens: int = 32768
    server_start_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError("--samples must be >= 1")
        self.ks = sorted(set(self.ks) or {1, self.samples})
        if not all(1 <= k <= self.samples for k in self.ks):
            raise ValueError(f"every --k must be in 1..--samples ({self.samples}): got {self.ks}")
        if self.temperature <= 0:
            raise ValueError("--temperature must be > 0 for the sampled answers (greedy runs anyway)")
        if self.max_new_tokens < 1 or self.concurrency < 1:
            raise ValueError("--max-new-tokens and --concurrency must be >= 1")
        if self.kind is None:
            self.kind = GENERATED.get(self.data) or detect_kind(self.data)
        if self.kind in GENERATED.values() and self.data != self.kind.value:
            raise ValueError(f"--format {self.kind.value} takes --data {self.kind.value}")
        if not self.ckpt:
            self.ckpt = COUNTDOWN_MODEL if self.kind is EvalSet.countdown else BUILTIN_MODEL
        if not self.out:
            self.out = str(Path("runs") / "eval" / f"{_name(self.ckpt)}-{_name(self.data)}")

    def spec(self) -> EvalSetSpec:
        path = "" if self.kind in GENERATED.values() else self.data
        return EvalSetSpec(self.kind, path, self.problem_field, self.answer_field, self.limit, self.data_seed)


def _name(path: str) -> str:
    p = Path(path)
    parts = [x for x in (p.parent.name, p.stem) if x and x not in (".", "..")]
    return "-".join(parts[-2:]) or "eval"


def parse_args(argv: list[str] | None = None) -> EvalArgs:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = EvalArgs.__dataclass_fields__
    p.add_argument(
        "--ckpt",
        default="",
        help="HF dir (final_hf/), or checkpoints/step_N (default: the task's warm start)",
    )
    p.add_argument("--data", default="builtin", help="'builtin', 'countdown' or a JSONL file")
    p.add_argument("--format", choices=[e.value for e in EvalSet], help="file layout (default: detected)")
    p.add_argument("--problem-field", default="problem", help="math layout: problem field (AIME: Problem)")
    p.add_argument("--answer-field", default="answer", help="math layout: answer field (AIME: Answer)")
    p.add_argument("--limit", type=int, default=0, help="first N problems (0 = all; built-in sets: 256)")
    p.add_argument("-n", "--samples", type=int, default=d["samples"].default, help="answers per problem")
    p.add_argument("-k", "--k", type=int, action="append", default=[], help="pass@k to report (repeat)")
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy (temperature 0) answers")
    p.add_argument("--max-new-tokens", type=int, default=d["max_new_tokens"].default)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--out", default="", help="output dir (default runs/eval/<ckpt>-<data>)")
    p.add_argument("--engine", choices=[e.value for e in RolloutEngine], default="sglang")
    p.add_argument("--dtype", choices=[e.value for e in DType], default="float32")
    p.add_argument("--seed", type=int, default=0, help="server sampling seed")
    p.add_argument("--data-seed", type=int, default=1, help="built-in sets: the run's data.seed")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    p.add_argument("--server-threads", type=int, default=1, help="CPU mode: torch threads of the server")
    a = p.parse_args(argv)
    return EvalArgs(
        ckpt=a.ckpt, data=a.data, kind=EvalSet(a.format) if a.format else None,
        problem_field=a.problem_field, answer_field=a.answer_field, limit=a.limit, samples=a.samples,
        ks=a.k, greedy=not a.no_greedy, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
        top_p=a.top_p, out=a.out, engine=RolloutEngine(a.engine), dtype=DType(a.dtype), seed=a.seed,
        data_seed=a.data_seed, concurrency=a.concurrency, server_threads=a.server_threads,
    )  # fmt: skip


def max_prompt_tokens(hf_dir: Path, max_new_tokens: int) -> int:
    """Prompts must leave room for the answer in the model's context."""
    context = json.loads((hf_dir / "config.json").read_text()).get("max_position_embeddings", 32768)
    if context <= max_new_tokens:
        raise ValueError(f"--max-new-tokens {max_new_tokens} leaves no room in the model's context {context}")
    return context - max_new_tokens


async def evaluate_on(client, args: EvalArgs, prompts, decode) -> tuple:
    """Sampled and greedy answers on one server through the training generation path."""
    from areal_jobs.reward.service import RewardService
    from areal_jobs.rollout.evaluation import evaluate_problems
    from areal_jobs.rollout.generation import GenerationPath, Sampling
    from areal_jobs.rollout.server_pool import ServerPool

    pool = ServerPool()
    pool.add(0, client)
    running = asyncio.Event()
    running.set()  # no weight update ever pauses an evaluation of a fixed checkpoint
    path = GenerationPath(pool, running, version=lambda: 0)
    scorer = RewardService(RewardConfig())
    scorer.start()
    try:
        common = dict(concurrency=args.concurrency)
        sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p)
        sampled = await evaluate_problems(
            path, scorer, prompts, decode, sampling=sampling, samples_per_problem=args.samples,
            ks=args.ks, tag="sampled", **common,
        )  # fmt: skip
        greedy = None
        if args.greedy:
            greedy = await evaluate_problems(
                path,
                scorer,
                prompts,
                decode,
                sampling=Sampling(args.max_new_tokens, 0.0),
                tag="greedy",
                **common,
            )
        return sampled, greedy
    finally:
        scorer.close()
        await client.close()


def run(args: EvalArgs) -> dict:
    from areal_jobs.data.tokenizer import load_tokenizer
    from areal_jobs.rollout.engines import make_client
    from areal_jobs.rollout.server import start_server
    from areal_jobs.transport.discovery import free_port
    from launch.evaluation.checkpoint import resolve_hf_dir

    t0 = time.monotonic()
    hf_dir = resolve_hf_dir(args.ckpt)
    tokenizer = load_tokenizer(hf_dir)
    prompts, report = read_eval_set(
        args.spec(), tokenizer.encode, max_prompt_tokens(hf_dir, args.max_new_tokens), str(hf_dir)
    )
    logger.info("%d problems from %s (%d rows skipped)", len(prompts), args.data, len(report.skipped))
    out = Path(args.out)
    rollout = RolloutConfig(
        engine=args.engine, max_total_tokens=args.max_total_tokens, server_threads=args.server_threads,
        max_concurrent=args.concurrency,
    )  # fmt: skip
    token = secrets.token_hex(16)
    server = start_server(
        str(hf_dir), "127.0.0.1", free_port(), token, rollout, ModelConfig(dtype=args.dtype),
        out / "logs" / f"{args.engine.value}.log", seed=args.seed,
    )  # fmt: skip
    try:
        server.wait_healthy(args.server_start_timeout_s)
        t_ready = time.monotonic()
        client = make_client(
            args.engine, "0", server.url, token, generate_timeout_s=rollout.request_timeout_s,
            call_timeout_s=rollout.call_timeout_s,
        )  # fmt: skip
        sampled, greedy = asyncio.run(evaluate_on(client, args, prompts, tokenizer.decode))
    finally:
        server.stop()
    meta = {
        "checkpoint": str(args.ckpt), "hf_dir": str(hf_dir), "data": args.data, "format": args.kind.value,
        "engine": args.engine.value, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "top_p": args.top_p, "rows_skipped": len(report.skipped), "server_start_s": round(t_ready - t0, 1),
        "eval_s": round(time.monotonic() - t_ready, 1),
    }  # fmt: skip
    result = build_report(sampled, greedy, args.ks, meta)
    json_path, png_path = write_report(out, result)
    logger.info("wrote %s and %s", json_path, png_path)
    return result


def main(argv: list[str] | None = None) -> int:
    setup_logging("evaluate")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        args = parse_args(argv)
        result = run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"launch.evaluate: {exc}", file=sys.stderr)
        return 2
    print(summary_line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
