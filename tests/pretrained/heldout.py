"""Held-out accuracy of the pretrained test checkpoint under several prompt settings, with the
project's own prompt builder (load_prompts), SGLang server, evaluation loop and math verifier.

    python -m tests.pretrained.heldout --eval-path ../shared/data/gsm8k/test.jsonl -n 32 \
        --out /tmp/heldout        # writes samples.jsonl per setting there

Settings: data.chat_template auto/none, each with the dataset's default instruction and with
data.instruction="" (no instruction); greedy (temperature 0) and, with --sampled, temperature 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
from pathlib import Path

from areal_jobs.config import DataConfig, Dataset, DType, ModelConfig, RolloutConfig
from areal_jobs.data.prompts import load_prompts
from areal_jobs.data.tokenizer import load_tokenizer
from areal_jobs.reward.math_answer import reward_math
from areal_jobs.rollout.evaluation import evaluate
from areal_jobs.rollout.server import start_server
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.rollout.sglang_client import SGLangClient
from areal_jobs.samples import SampleDump
from areal_jobs.transport.discovery import free_port
from tests.pretrained.smollm2 import smollm2_dir

SETTINGS = [("auto", None), ("auto", ""), ("none", None), ("none", "")]


class InlineScorer:
    """The math verifier in this process (the run uses the reward worker pool; same function)."""

    async def score_group(self, requests):
        return [reward_math(r.response, r.reference) for r in requests]


async def run(args, model_dir: Path, server) -> list[dict]:
    tok = load_tokenizer(model_dir)
    pool = ServerPool()
    pool.add(0, SGLangClient("0", server.url, server.api_key, generate_timeout_s=3600, call_timeout_s=60))
    running = asyncio.Event()
    running.set()
    results = []
    for template, instruction in SETTINGS:
        data = DataConfig(dataset=Dataset.gsm8k, train_path=args.eval_path, eval_path=args.eval_path,
                          num_eval_prompts=args.n, chat_template=template, instruction=instruction)  # fmt: skip
        prompts = load_prompts(data, str(model_dir), tok.encode)
        for temperature in [0.0, 1.0] if args.sampled else [0.0]:
            tag = f"{template}-{'default' if instruction is None else 'no'}_instruction-t{temperature:g}"
            dump = SampleDump(Path(args.out) / f"{tag}.jsonl", print_first=0)
            summary = await evaluate(
                pool, InlineScorer(), prompts.held_out, tok.decode, max_new_tokens=args.max_new_tokens,
                temperature=temperature, running=running, tag=tag, stop_token_ids=tok.stop_token_ids,
                dump=dump.write, decode_raw=tok.decode_raw,
            )  # fmt: skip
            row = {"setting": tag, "accuracy": summary.accuracy, "correct": round(summary.accuracy * args.n),
                   "n": args.n, "first_prompt": prompts.held_out and tok.decode_raw(prompts.held_out[0].input_ids)}  # fmt: skip
            print(json.dumps(row), flush=True)
            results.append(row)
    await pool.slots[0].client.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--eval-path", required=True)
    parser.add_argument("-n", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--sampled", action="store_true")
    parser.add_argument("--out", default="/tmp/heldout")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    model_dir = smollm2_dir()
    server = start_server(
        str(model_dir), "127.0.0.1", free_port(), secrets.token_hex(8), RolloutConfig(max_total_tokens=32768),
        ModelConfig(path=str(model_dir), dtype=DType.float32), Path(args.out) / "server.log", seed=0,
    )  # fmt: skip
    try:
        server.wait_healthy(timeout_s=600)
        asyncio.run(run(args, model_dir, server))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
