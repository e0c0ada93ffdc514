"""The built-in policy: a byte-level BPE tokenizer and a tiny Qwen2 model, built locally.

Nothing is downloaded. `build_builtin_model` trains the tokenizer on generated task text,
initialises a tiny Qwen2ForCausalLM, gives it a short supervised warm start on worked
solutions (weak but not hopeless: the RL run measures where it starts), and saves a Hugging
Face directory (config.json, model.safetensors, tokenizer.json) that SGLang and the trainer load.

The result is cached by recipe: a directory whose `build.json` holds the same recipe is reused.
The default recipe's build is committed in areal_jobs/tasks/models/builtin_model/ (a few MB), so
`make run` spends its CPU minutes on RL; `make warmstart` rebuilds it:

    python -m areal_jobs.tasks.warm_start.tiny_model --out areal_jobs/tasks/models/builtin_model
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from areal_jobs.tasks import arith_task

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
SFT_SEED = 7
_SFT_MICROBATCH_TOKENS = (
    512  # the warm-start stream is disjoint from RL training (data.seed) and eval streams
)


@dataclass(frozen=True)
class TinyRecipe:
    """Everything that determines the built model; stored in build.json as the cache key."""

    vocab_size: int = 384
    hidden_size: int = 128
    intermediate_size: int = 1024
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 512
    sft_steps: int = 2000  # phase 1: correct worked answers (the arithmetic facts are learned here)
    sft_decay_steps: int = 3000  # phase 1's cosine horizon: it stops before the rate has decayed
    sft_tokens_per_step: int = 512
    sft_lr: float = 3e-3
    careless_steps: int = 300  # phase 2: careless answers at a constant rate
    careless_lr: float = 1e-3
    sft_slip_rate: float = 0.4  # phases 2 and 3: share of result digits written wrong
    misconception_steps: int = 600  # phase 3: careless answers with the misconception
    misconception_lr: float = 1e-3
    # share of misconception facts' results (arith_task.MISCONCEPTION_FACTS) written one digit too high: above 0.5
    # the greedy answer is wrong on those facts while the right one keeps a minority of the probability
    misconception_rate: float = 0.7
    seed: int = 0
    recipe_version: int = 3


def build_tokenizer(out_dir: Path, vocab_size: int, corpus: list[str] | None = None):
    """Byte-level BPE trained on task text (`corpus`; default: the arithmetic task's prompts and
    solutions); digits are always single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # single-digit tokens keep arithmetic learnable: "19" is always ["1", "9"]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if corpus is None:
        corpus = []
        for i in range(4000):
            p = arith_task.problem_at(SFT_SEED + 11, i)
            corpus += [p.prompt, p.solution]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    fast.save_pretrained(str(out_dir))
    return fast


def model_config(recipe: TinyRecipe, vocab_size: int):
    """The tiny Qwen2 of `recipe`'s shape fields (TinyRecipe's; countdown_model's recipe has the same)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.max_positions,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        torch_dtype="float32",
    )


PACKAGED_DIR = Path(__file__).resolve().parents[1] / "models" / "builtin_model"


_PHASE3_FIELDS = ("misconception_steps", "misconception_lr", "misconception_rate", "recipe_version")


def build_builtin_model(
    out_dir: Path, recipe: TinyRecipe, threads: int = 2, force: bool = False, base: Path | None = None
) -> Path:
    """Build (or reuse) the warm-started tiny model in `out_dir`; returns `out_dir`.

    `base`: a built model whose recipe agrees on everything before phase 3; its weights are the
    phase-2 result, so only phase 3 runs (minutes saved; the same result up to float rounding)."""
    import torch
    from transformers import Qwen2ForCausalLM

    stamp = out_dir / "build.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("recipe") == asdict(recipe) and not force:
        logger.info("built-in model up to date in %s", out_dir)
        return out_dir
    if Path(out_dir).resolve() == PACKAGED_DIR and stamp.exists() and not force:
        raise ValueError(
            f"model.builtin_sft_steps={recipe.sft_steps} differs from the committed warm start in {PACKAGED_DIR}: "
            "set model.builtin_dir=<another directory> to build a different one there"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    torch.set_num_threads(threads)
    torch.manual_seed(recipe.seed)
    tokenizer = build_tokenizer(out_dir, recipe.vocab_size)
    if base is None:
        model = Qwen2ForCausalLM(model_config(recipe, len(tokenizer)))
    else:
        base_recipe = json.loads((base / "build.json").read_text())["recipe"]
        differ = [k for k, v in asdict(recipe).items() if k not in _PHASE3_FIELDS and base_recipe.get(k) != v]
        if differ:
            raise ValueError(f"--base {base} was built with other phase-1/2 settings: {differ}")
        model = Qwen2ForCausalLM.from_pretrained(str(base), torch_dtype=torch.float32)
    final_loss = _warm_start(model, tokenizer, recipe, phase3_only=base is not None)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    info = {"recipe": asdict(recipe), "sft_final_loss": final_loss, "build_s": time.time() - t0}
    if base is not None:
        info["phases_1_2_from"] = json.loads((base / "build.json").read_text())
    if recipe.sft_steps:
        from areal_jobs.tasks.warm_start import fact_probe

        info["heldout"] = heldout_accuracy(model, tokenizer)
        info["facts"] = fact_probe.summarize(fact_probe.probe(model, tokenizer))
    stamp.write_text(json.dumps(info, indent=2))
    logger.info("built-in model built in %.0fs (SFT loss %.3f) -> %s", info["build_s"], final_loss, out_dir)
    return out_dir


def left_pad(rows: list[list[int]]):
    """Token rows as (ids, attention mask) long tensors [len(rows), longest], padded on the left,
    so that `generate` continues every row from its last token."""
    import torch

    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row) :] = torch.tensor(row)
        mask[r, width - len(row) :] = 1
    return ids, mask


def heldout_scores(
    model, tokenizer, problems: list, score, max_new_tokens: int, seed: int = 1
) -> dict[str, float]:
    """Mean `score(answer_text, problem)` over `problems`, greedy and sampled at temperature 1 with
    HF generate (64 prompts a call, left-padded), and the mean answer length in tokens (EOS counted)."""
    import torch

    torch.manual_seed(seed)
    out: dict[str, float] = {}
    for name, sample in (("greedy", False), ("sampled", True)):
        correct, tokens = 0.0, 0
        for start in range(0, len(problems), 64):
            chunk = problems[start : start + 64]
            ids, mask = left_pad([tokenizer.encode(p.prompt, add_special_tokens=False) for p in chunk])
            with torch.no_grad():
                gen = model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=sample,
                    temperature=1.0 if sample else None, top_p=1.0, top_k=0, pad_token_id=0, eos_token_id=0,
                )  # fmt: skip
            for row, p in enumerate(chunk):
                answer = gen[row, ids.shape[1] :]
                tokens += int((answer != 0).sum()) + 1
                correct += score(tokenizer.decode(answer, skip_special_tokens=True), p)
        out[name] = correct / len(problems)
        out[f"{name}_mean_tokens"] = tokens / len(problems)
    return out


def heldout_accuracy(model, tokenizer, num_prompts: int = 256, seed: int = 1) -> dict[str, float]:
    """Accuracy on the held-out stream (data.seed=1), greedy and sampled at temperature 1."""
    problems = [arith_task.eval_problem_at(seed, i) for i in range(num_prompts)]
    return heldout_scores(
        model, tokenizer, problems, lambda text, p: arith_task.reward(text, str(p.answer)).reward, 256, seed
    )


def sft_example(
    tokenizer, problem: arith_task.ArithProblem, solution: str | None = None
) -> tuple[list[int], int]:
    """Token ids of prompt + solution + EOS, and the prompt length (loss starts after it).

    Prompt and solution are tokenised separately, exactly as generation sees them: the server
    continues from the prompt's ids, so the boundary must not be merged by BPE.
    """
    prompt = tokenizer.encode(problem.prompt, add_special_tokens=False)
    answer = tokenizer.encode(solution or problem.solution, add_special_tokens=False) + [
        tokenizer.eos_token_id
    ]
    return prompt + answer, len(prompt)


def _warm_start(model, tokenizer, recipe: TinyRecipe, phase3_only: bool = False) -> float:
    """Packed SFT (no padding) in three phases; each step packs examples up to `sft_tokens_per_step`.

    Phase 1 teaches the task from correct answers, stopping early (weak on long chains). Phase 2
    continues on careless answers (`sft_slip_rate`): the sampling distribution spreads out while
    the most likely digit stays right. Phase 3 (fresh optimiser, its own problem stream) goes on
    with careless answers that also carry the misconception: `misconception_rate` of the results
    of misconception facts (arith_task.MISCONCEPTION_FACTS) go one too high. The result is wrong
    *systematically* on those 18 facts (greedy picks the wrong digit; the right one keeps a minority
    of the probability) and diffuse elsewhere: RL has an error to discover, not only entropy to lower.
    `phase3_only` starts from a model that already went through phases 1-2 (the same recipe).
    """
    import torch

    if not recipe.sft_steps:  # sft_steps=0: an untrained model (fast, for tests)
        return float("nan")
    loss = float("nan")
    if not phase3_only:
        slips = random.Random(recipe.seed + 1)
        sft_lr = warmup_cosine(recipe.sft_lr, recipe.sft_decay_steps)

        def lr12(step: int) -> float:
            return recipe.careless_lr if step >= recipe.sft_steps else sft_lr(step)

        def answer12(problem: arith_task.ArithProblem, step: int) -> str | None:
            if step < recipe.sft_steps:
                return None
            return arith_task.worked_solution(problem.start, problem.ops, recipe.sft_slip_rate, slips)[0]

        opt = torch.optim.AdamW(model.parameters(), lr=recipe.sft_lr, weight_decay=0.0)
        total = recipe.sft_steps + recipe.careless_steps
        loss = sft_loop(
            model, opt, recipe.sft_tokens_per_step, total, lr12, answer_examples(tokenizer, answer12), SFT_SEED,
            "warm start (SFT)",
        )  # fmt: skip
    if recipe.misconception_steps:
        mistakes = random.Random(recipe.seed + 2)
        # warm-up, then cosine to 0: the last weights fit the data's odds
        lr3 = warmup_cosine(recipe.misconception_lr, recipe.misconception_steps)

        def answer3(problem: arith_task.ArithProblem, step: int) -> str:
            return arith_task.worked_solution(
                problem.start, problem.ops, recipe.sft_slip_rate, mistakes,
                misconception_rate=recipe.misconception_rate,
            )[0]  # fmt: skip

        opt = torch.optim.AdamW(model.parameters(), lr=recipe.misconception_lr, weight_decay=0.0)
        loss = sft_loop(
            model, opt, recipe.sft_tokens_per_step, recipe.misconception_steps, lr3,
            answer_examples(tokenizer, answer3), SFT_SEED + 1, "warm start (misconception)",
        )  # fmt: skip
    model.eval()
    return loss


def warmup_cosine(peak_lr: float, decay_steps: int) -> Callable[[int], float]:
    """The warm starts' schedule: linear warm-up over a tenth of `decay_steps`, then cosine from
    `peak_lr` to 0 at `decay_steps` (0 after it)."""
    warmup = max(1, decay_steps // 10)

    def lr_at(step: int) -> float:
        if step < warmup:
            return peak_lr * (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, decay_steps - warmup))
        return peak_lr * 0.5 * (1 + math.cos(math.pi * progress))

    return lr_at


def answer_examples(tokenizer, answer_at):
    """`example_at` for sft_loop from `answer_at(problem, step)`, the worked answer to imitate
    (None: the correct one): loss on the answer and EOS only."""

    def example_at(problem: arith_task.ArithProblem, step: int) -> tuple[list[int], list[int]]:
        ids, prompt_len = sft_example(tokenizer, problem, answer_at(problem, step))
        return ids, [0] * prompt_len + [1] * (len(ids) - prompt_len)

    return example_at


def sft_loop(model, opt, tokens_per_step: int, steps: int, lr_at, example_at, stream_seed: int,
             desc: str, problem_at=arith_task.problem_at) -> float:  # fmt: skip
    """`steps` packed SFT steps on problems `problem_at(stream_seed, 0)`, 1, ...;
    `example_at(problem, step)` gives an example's token ids and loss mask. Returns the last
    step's loss."""
    import numpy as np
    import torch
    from tqdm import tqdm

    from areal_jobs.trainer.intake.packing import balanced_microbatches, pack

    model.train()
    loss_value, index = float("nan"), 0
    for step in tqdm(range(steps), desc=desc, unit="step", mininterval=5.0):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        seqs, masks, used = [], [], 0
        while used < tokens_per_step:
            problem = problem_at(stream_seed, index)
            index += 1
            ids, loss_mask = example_at(problem, step)
            seqs.append(np.asarray(ids))
            masks.append(np.asarray(loss_mask, dtype=bool))
            used += len(ids)
        opt.zero_grad(set_to_none=True)
        num_targets = float(sum(int(mk.sum()) for mk in masks))
        loss_value = 0.0
        # small packed micro-batches: dense masked attention costs O(T^2) per micro-batch
        for mb in balanced_microbatches([len(x) for x in seqs], _SFT_MICROBATCH_TOKENS):
            packed = pack([seqs[i] for i in mb])
            input_ids = torch.from_numpy(packed.input_ids).unsqueeze(0)
            position_ids = torch.from_numpy(packed.position_ids).unsqueeze(0)
            out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
            logits = out.logits[0, :-1]
            target_mask = torch.from_numpy(np.concatenate([masks[i] for i in mb]))[1:]
            # a sequence's last token must not predict the next sequence's first: those are prompts (masked)
            nll = torch.nn.functional.cross_entropy(logits.float(), input_ids[0, 1:], reduction="none")
            loss = (nll * target_mask).sum() / num_targets
            if getattr(out, "aux_loss", None) is not None:  # a mixture of experts asked for router logits
                # its load-balancing loss (over the micro-batch's tokens, all real: packed), weighted
                # by the micro-batch's share of the step's targets like the language-model loss
                share = float(target_mask.sum()) / num_targets
                loss = loss + model.config.router_aux_loss_coef * share * out.aux_loss
            loss.backward()
            loss_value += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return loss_value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the built-in tiny model (tokenizer + warm start).")
    parser.add_argument("--out", type=Path, default=PACKAGED_DIR, help="HF directory to write")
    parser.add_argument(
        "--sft-steps", type=int, default=TinyRecipe.sft_steps, help="phase-1 warm-start steps"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--base", type=Path, default=None,
        help="a model built with the same phase-1/2 settings: run phase 3 (the misconception) on it",
    )  # fmt: skip
    for name in ("misconception_steps", "misconception_rate", "misconception_lr"):
        kind = type(getattr(TinyRecipe(), name))
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=getattr(TinyRecipe(), name))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    recipe = replace(
        TinyRecipe(), sft_steps=args.sft_steps, misconception_steps=args.misconception_steps,
        misconception_rate=args.misconception_rate, misconception_lr=args.misconception_lr,
    )  # fmt: skip
    build_builtin_model(args.out, recipe, threads=args.threads, force=True, base=args.base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
