"""The countdown warm start: areal_jobs/tasks/models/builtin_model_countdown, a tokenizer and a tiny Qwen2
trained on worked countdown answers (tasks/countdown_task.py), committed like builtin_model.

    python -m areal_jobs.tasks.warm_start.countdown_model --out areal_jobs/tasks/models/builtin_model_countdown
    python -m areal_jobs.tasks.warm_start.countdown_model --measure areal_jobs/tasks/models/builtin_model_countdown

(`make warmstart-countdown`.) Two phases. Phase 1 (1,500 steps; `--sft-steps 1500
--sft-decay-steps 1500`) imitates a guided worker (countdown_task.guided_solution: 0-3 wrong
attempts, then a right one): the format and the arithmetic. A model trained on it alone (greedy
0.72, sampled 0.52) cannot imitate a worker who knows where the answer is: after a few misses it
says "yes" to wrong values. Phase 2 (400 steps, fresh AdamW 1e-3) imitates the searching worker
(countdown_task.search_solution: random order, at most MAX_TRIES, else "answer: none"), which a
policy can follow exactly: the committed model answers 0.45 greedy, 0.33 sampled at temperature 1
on the held-out problems (build.json: `heldout`), and gives up ("answer: none") on about a quarter.
RL has room to learn which attempts to try first and not to give up. Built in one process on 2 CPU
threads (build.json: `build_s`, phase 2 from the phase-1 model with `--base`: 1,938 s beside a CI run).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from areal_jobs.tasks import countdown_task
from areal_jobs.tasks.warm_start.tiny_model import (
    EOS_TOKEN,
    build_tokenizer,
    heldout_scores,
    model_config,
    sft_loop,
    warmup_cosine,
)

logger = logging.getLogger(__name__)

COUNTDOWN_DIR = Path(__file__).resolve().parents[1] / "models" / "builtin_model_countdown"
SFT_SEED = 11  # the warm-start problem stream (training runs use data.seed, held-out EVAL_SEED_OFFSET)
MAX_NEW_TOKENS = 192  # conf/experiment/countdown.yaml's rollout.max_new_tokens


@dataclass(frozen=True)
class CountdownRecipe:
    """Everything that determines the built model; stored in build.json."""

    vocab_size: int = 384
    hidden_size: int = 128
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 512
    sft_steps: int = 700
    sft_decay_steps: int = 700  # cosine horizon
    sft_tokens_per_step: int = 1024
    sft_lr: float = 3e-3
    max_misses: int = 3  # wrong attempts before the right one: uniform in 0..max_misses
    # phase 2: the searching worker (countdown_task.search_solution), fresh optimiser, cosine to 0
    search_steps: int = 400
    search_lr: float = 1e-3
    max_tries: int = countdown_task.MAX_TRIES
    seed: int = 0
    recipe_version: int = 3


_PHASE2_FIELDS = ("search_steps", "search_lr", "max_tries", "recipe_version")


_CLI_FIELDS = ("sft_steps", "sft_decay_steps", "sft_lr", "max_misses", "num_layers", "seed", "search_steps",
               "search_lr", "max_tries")  # fmt: skip


def tokenizer_corpus(num_problems: int = 3000) -> list[str]:
    rng = random.Random(SFT_SEED + 1)
    corpus = []
    for i in range(num_problems):
        p = countdown_task.problem_at(SFT_SEED + 2, i)
        corpus += [p.prompt, countdown_task.guided_solution(p, rng)]
    return corpus


def build(out_dir: Path, recipe: CountdownRecipe, threads: int = 2, base: Path | None = None) -> dict:
    """Tokenizer, model and warm start in `out_dir`; returns build.json's content. `base`: a model
    built with the same phase-1 settings (its weights are phase 1's result): only phase 2 runs."""
    import torch
    from transformers import Qwen2ForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    torch.set_num_threads(threads)
    torch.manual_seed(recipe.seed)
    tokenizer = build_tokenizer(out_dir, recipe.vocab_size, tokenizer_corpus())
    info: dict = {"recipe": asdict(recipe)}
    if base is None:
        model = Qwen2ForCausalLM(model_config(recipe, len(tokenizer)))
        guided = functools.partial(countdown_task.guided_solution, max_misses=recipe.max_misses)
        info["sft_final_loss"] = _phase(model, tokenizer, recipe, recipe.sft_steps, recipe.sft_decay_steps,
                                        recipe.sft_lr, guided, SFT_SEED, "countdown warm start", rng_seed=1)  # fmt: skip
    else:
        base_info = json.loads((base / "build.json").read_text())
        differ = [
            k
            for k, v in asdict(recipe).items()
            if k not in _PHASE2_FIELDS and base_info["recipe"].get(k) != v
        ]
        if differ:
            raise ValueError(f"--base {base} was built with other phase-1 settings: {differ}")
        model = Qwen2ForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        info["phase_1_from"] = base_info
    if recipe.search_steps:
        search = functools.partial(countdown_task.search_solution, max_tries=recipe.max_tries)
        info["search_final_loss"] = _phase(model, tokenizer, recipe, recipe.search_steps, recipe.search_steps,
                                           recipe.search_lr, search, SFT_SEED + 1, "countdown search", rng_seed=2)  # fmt: skip
    model.eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    info["build_s"] = round(time.time() - t0, 1)
    info["heldout"] = heldout_accuracy(model, tokenizer)
    (out_dir / "build.json").write_text(json.dumps(info, indent=2))
    logger.info("countdown model built in %.0fs: %s -> %s", info["build_s"], info["heldout"], out_dir)
    return info


def _phase(model, tokenizer, recipe, steps: int, decay_steps: int, lr: float, worker: Callable,
           stream_seed: int, desc: str, rng_seed: int) -> float:  # fmt: skip
    """One packed SFT phase: a tenth of warm-up, then cosine over `decay_steps` (phase 1 stops
    before the end of its schedule when decay_steps > steps); a fresh AdamW."""
    import torch

    rng = random.Random(recipe.seed + rng_seed)  # the worked answers' choices

    def example_at(problem: countdown_task.CountdownProblem, step: int) -> tuple[list[int], list[int]]:
        prompt = tokenizer.encode(problem.prompt, add_special_tokens=False)
        answer = worker(problem, rng)
        ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        return prompt + ids, [0] * len(prompt) + [1] * len(ids)

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    return sft_loop(
        model, opt, recipe.sft_tokens_per_step, steps, warmup_cosine(lr, decay_steps), example_at, stream_seed, desc,
        problem_at=countdown_task.problem_at,
    )  # fmt: skip


def heldout_accuracy(model, tokenizer, num_prompts: int = 256, seed: int = 1) -> dict[str, float]:
    """Held-out accuracy (data.seed=1's evaluation stream), greedy and sampled at temperature 1,
    with HF generate and the reward service's verifier; also the mean answer length in tokens."""
    from areal_jobs.reward.countdown import reward_countdown

    problems = [countdown_task.eval_problem_at(seed, i) for i in range(num_prompts)]
    return heldout_scores(
        model,
        tokenizer,
        problems,
        lambda text, p: reward_countdown(text, p.reference).reward,
        MAX_NEW_TOKENS,
        seed,
    )


def measure(folder: Path, num_prompts: int = 256) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    return heldout_accuracy(model, tokenizer, num_prompts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build (or measure) the countdown warm start.")
    parser.add_argument("--out", type=Path, default=COUNTDOWN_DIR, help="HF directory to write")
    parser.add_argument("--measure", type=Path, default=None, help="only measure this built model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--base", type=Path, default=None, help="a phase-1 model of the same recipe: run phase 2 on it"
    )
    for name in _CLI_FIELDS:
        kind = type(getattr(CountdownRecipe(), name))
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=getattr(CountdownRecipe(), name)
        )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.measure is not None:
        print(json.dumps(measure(args.measure), indent=2))
        return 0
    recipe = replace(CountdownRecipe(), **{k: getattr(args, k) for k in _CLI_FIELDS})
    print(json.dumps(build(args.out, recipe, args.threads, args.base), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["EOS_TOKEN", "CountdownRecipe", "build", "heldout_accuracy", "measure"]
