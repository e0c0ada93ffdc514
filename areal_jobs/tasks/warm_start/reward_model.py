"""The built-in reward model: a tiny Qwen2ForSequenceClassification that predicts whether an answer
to the built-in task is right, committed in areal_jobs/tasks/models/builtin_reward_model/.

    python -m areal_jobs.tasks.warm_start.reward_model          (make reward-model; ~18 min on 2 cores: 4 min sampling, 14 min training)

Its data are the committed policy's own answers (areal_jobs/tasks/models/builtin_model), sampled at
temperature 1 on problems of a stream no run trains or evaluates on, each labelled by the real
verifier (arith_task.reward: 1 when the stated answer is right, else 0, no answer included). The
classifier starts from the policy's backbone (same tokenizer, same layers: it already knows the
arithmetic facts) with a fresh one-logit head, and is trained with a logistic loss on
prompt ids + answer ids (no end token: SGLang pools the last position, Hugging Face the last
non-padding one, and the pad id is the end id). Its held-out agreement with the verifier is
measured on problems and answers it never saw, and written to build.json.

SGLang serves Qwen2ForSequenceClassification with a head bias that Hugging Face's lacks
(rollout/reward_server.py): the checkpoint carries `score.bias` = 0, so both compute the same
logit.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from areal_jobs.tasks import arith_task
from areal_jobs.tasks.warm_start.tiny_model import PACKAGED_DIR as POLICY_DIR
from areal_jobs.tasks.warm_start.tiny_model import left_pad

logger = logging.getLogger(__name__)

PACKAGED_RM_DIR = Path(__file__).resolve().parents[1] / "models" / "builtin_reward_model"
TRAIN_STREAM = 424_242  # problems of neither the RL stream (data.seed) nor the held-out one
HELDOUT_STREAM = 525_252


@dataclass(frozen=True)
class RewardModelRecipe:
    """Everything that determines the built reward model; build.json's cache key."""

    train_problems: int = 1500
    answers_per_problem: int = 4
    # worked answers with random slips and the misconception, self-consistent chains (as the
    # policy's own wrong answers are), labelled by the verifier: wrong chains of every shape, so
    # the model learns to check the steps rather than the policy's habits (a model trained on the
    # policy's samples alone learnt "answers ending in 9 are right", and RL on it found that)
    synthetic_per_problem: int = 4
    slip_rate: float = 0.25
    heldout_problems: int = 256
    temperature: float = 1.0
    max_new_tokens: int = 192
    epochs: int = 4
    batch_size: int = 32
    lr: float = 5e-4
    seed: int = 0
    recipe_version: int = 2


def sample_answers(model, tokenizer, problems, per_problem: int, temperature: float, max_new_tokens: int,
                   batch: int = 64) -> list[tuple[arith_task.ArithProblem, str]]:  # fmt: skip
    """`per_problem` sampled answers of the policy to each problem: (problem, answer text)."""
    import torch

    # batches of similar chain length: a batch generates until its longest answer ends
    rows = sorted((p for p in problems for _ in range(per_problem)), key=lambda p: p.num_steps)
    out = []
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        ids, mask = left_pad([tokenizer.encode(p.prompt, add_special_tokens=False) for p in chunk])
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=True,
                temperature=temperature, top_p=1.0, top_k=0, pad_token_id=0, eos_token_id=0,
            )  # fmt: skip
        for r, p in enumerate(chunk):
            out.append((p, tokenizer.decode(gen[r, ids.shape[1] :], skip_special_tokens=True)))
        if len(out) % 1024 < batch:
            logger.info("sampled %d/%d answers", len(out), len(rows))
    return out


def synthetic_answers(problems, per_problem: int, slip_rate: float, seed: int
                      ) -> list[tuple[arith_task.ArithProblem, str]]:  # fmt: skip
    """`per_problem` worked answers to each problem, each step slipping to a random wrong digit with
    probability `slip_rate` and the misconception written half the time (tasks/arith_task.py)."""
    rng = random.Random(seed)
    return [
        (p, arith_task.worked_solution(p.start, p.ops, slip_rate, rng, misconception_rate=0.5)[0])
        for p in problems
        for _ in range(per_problem)
    ]


def label(problem: arith_task.ArithProblem, answer: str) -> float:
    """The verifier's verdict: 1.0 right, 0.0 wrong or no stated answer."""
    return arith_task.reward(answer, str(problem.answer)).reward


def rm_input(tokenizer, prompt: str, answer: str) -> list[int]:
    """What the reward model reads: the prompt's ids then the answer's, each encoded on its own
    (reward/model_scorer.py builds the same for reward.model.input=raw)."""
    return tokenizer.encode(prompt, add_special_tokens=False) + tokenizer.encode(
        answer, add_special_tokens=False
    )


def logits_of(model, rows: list[list[int]], batch: int = 64) -> list[float]:
    """The classifier's logit for each row (right-padded with the pad id, which no row holds)."""
    import torch

    out = []
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, row in enumerate(chunk):
            ids[r, : len(row)] = torch.tensor(row)
        with torch.no_grad():
            out += model(input_ids=ids).logits[:, 0].tolist()
    return out


def agreement(logits: list[float], labels: list[float]) -> dict[str, float]:
    """How often the model's call (logit >= 0, i.e. P(right) >= 0.5) equals the verifier's."""
    calls = [x >= 0.0 for x in logits]
    right = [y >= 1.0 for y in labels]
    positives = sum(calls)
    # AUC: the chance a right answer scores above a wrong one (what the policy's advantages use:
    # a group's answers ranked by score), ties counted half
    pos = sorted(x for x, r in zip(logits, right) if r)
    neg = sorted(x for x, r in zip(logits, right) if not r)

    wins = sum(
        bisect.bisect_left(neg, x) + 0.5 * (bisect.bisect_right(neg, x) - bisect.bisect_left(neg, x))
        for x in pos
    )
    return {
        "auc": wins / (len(pos) * len(neg)) if pos and neg else 0.0,
        "answers": float(len(labels)),
        "verifier_accuracy": sum(right) / len(right),
        "agreement": sum(c == r for c, r in zip(calls, right)) / len(right),
        "precision": sum(c and r for c, r in zip(calls, right)) / positives if positives else 0.0,
        "recall": sum(c and r for c, r in zip(calls, right)) / max(sum(right), 1),
    }


def build_reward_model(out_dir: Path, recipe: RewardModelRecipe, policy_dir: Path = POLICY_DIR,
                       threads: int = 2, force: bool = False) -> Path:  # fmt: skip
    """Build (or reuse, when build.json holds the same recipe) the reward model in `out_dir`."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    stamp = out_dir / "build.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("recipe") == asdict(recipe) and not force:
        logger.info("built-in reward model up to date in %s", out_dir)
        return out_dir
    t0 = time.time()
    torch.set_num_threads(threads)
    torch.manual_seed(recipe.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(policy_dir))
    policy = Qwen2ForCausalLM.from_pretrained(str(policy_dir), torch_dtype=torch.float32).eval()
    train_problems = [arith_task.problem_at(TRAIN_STREAM, i) for i in range(recipe.train_problems)]
    heldout_problems = [arith_task.problem_at(HELDOUT_STREAM, i) for i in range(recipe.heldout_problems)]
    sample = dict(temperature=recipe.temperature, max_new_tokens=recipe.max_new_tokens)
    train = sample_answers(policy, tokenizer, train_problems, recipe.answers_per_problem, **sample)
    heldout = sample_answers(policy, tokenizer, heldout_problems, recipe.answers_per_problem, **sample)
    t_sampled = time.time()

    model = Qwen2ForSequenceClassification.from_pretrained(
        str(policy_dir), num_labels=1, torch_dtype=torch.float32
    )  # the policy's backbone; the head is new
    model.config.architectures = ["Qwen2ForSequenceClassification"]
    torch.nn.init.normal_(model.score.weight, std=0.02)
    train += synthetic_answers(train_problems, recipe.synthetic_per_problem, recipe.slip_rate, recipe.seed)
    rows = [rm_input(tokenizer, p.prompt, a) for p, a in train]
    labels = [label(p, a) for p, a in train]
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    total = recipe.epochs * -(-len(rows) // recipe.batch_size)
    warmup = max(1, total // 20)  # then linear to 0: the last steps settle the head
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min((i + 1) / warmup, max(0.0, (total - i) / max(1, total - warmup)))
    )
    order = list(range(len(rows)))
    rng = random.Random(recipe.seed)
    model.train()
    loss_value = float("nan")
    for epoch in range(recipe.epochs):
        rng.shuffle(order)
        epoch_losses = []
        for start in range(0, len(order), recipe.batch_size):
            index = order[start : start + recipe.batch_size]
            width = max(len(rows[i]) for i in index)
            ids = torch.zeros(len(index), width, dtype=torch.long)
            for r, i in enumerate(index):
                ids[r, : len(rows[i])] = torch.tensor(rows[i])
            target = torch.tensor([labels[i] for i in index])
            logit = model(input_ids=ids).logits[:, 0]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            epoch_losses.append(float(loss.detach()))
        loss_value = sum(epoch_losses) / len(epoch_losses)
        logger.info("epoch %d: mean loss %.4f", epoch + 1, loss_value)
    model.eval()
    heldout_logits = logits_of(model, [rm_input(tokenizer, p.prompt, a) for p, a in heldout])
    policy_rows = len(train_problems) * recipe.answers_per_problem  # the policy's own answers first
    train_logits = logits_of(model, rows[: min(1024, policy_rows)])

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(policy_dir / name, out_dir / name)
    weights = out_dir / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["score.bias"] = torch.zeros(1)  # SGLang's head has a bias: zero, as Hugging Face's has none
    save_file(tensors, str(weights), metadata={"format": "pt"})
    info = {
        "recipe": asdict(recipe),
        "policy": str(policy_dir.name),
        "final_loss": loss_value,
        "train": agreement(train_logits, labels[: len(train_logits)]),
        # problems and answers the model never saw, labelled by the verifier
        "heldout": agreement(heldout_logits, [label(p, a) for p, a in heldout]),
        "sample_s": t_sampled - t0,
        "build_s": time.time() - t0,
    }
    stamp.write_text(json.dumps(info, indent=2))
    logger.info("reward model built in %.0fs: held-out %s -> %s", info["build_s"], info["heldout"], out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the built-in reward model (answer correctness).")
    parser.add_argument("--out", type=Path, default=PACKAGED_RM_DIR, help="HF directory to write")
    parser.add_argument("--policy", type=Path, default=POLICY_DIR, help="the policy whose answers it learns")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--train-problems", type=int, default=RewardModelRecipe.train_problems)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    recipe = RewardModelRecipe(train_problems=args.train_problems)
    build_reward_model(args.out, recipe, args.policy, threads=args.threads, force=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
