"""The tool-use warm start: areal_jobs/tasks/models/builtin_model_tools, the built-in model (tasks/models/builtin_model)
fine-tuned a little further on answers where some steps call the calculator (tasks/arith_tools.py).

The fine-tune keeps the base's answers, misconception and slips included (phase 3 of
tasks/warm_start/tiny_model.py), and turns `tool_rate` of the steps into calls, whose result is the tool's
right digit (tokens the model does not learn to write: loss mask 0). So the model calls rarely and
its own digits stay as unreliable as the base's: RL on `rollout/workflow=tool_arith` has a
behaviour to amplify (calling) that pays off (a called step is right). Committed like builtin_model
(a few MB); rebuild, from the committed base, measured on the held-out stream:

    python -m areal_jobs.tasks.warm_start.tool_warm_start --out areal_jobs/tasks/models/builtin_model_tools
    python -m areal_jobs.tasks.warm_start.tool_warm_start --measure areal_jobs/tasks/models/builtin_model_tools

Held-out measurement (`tool_heldout`) runs the tool_arith loop with Hugging Face generate: stop
after "</calc>", append the calculator's answer (agent/tools.py), continue; greedy and sampled.
It lives in agent/, not data/, because it calls the calculator, as the workflow does.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from areal_jobs.agent.tools import calculator
from areal_jobs.tasks import arith_task
from areal_jobs.tasks.arith_tools import (
    CALL_CLOSE,
    CALL_OPEN,
    expression_of,
    segment_ids,
    tool_worked_solution,
)
from areal_jobs.tasks.warm_start import fact_probe
from areal_jobs.tasks.warm_start.tiny_model import (
    PACKAGED_DIR,
    SFT_SEED,
    TinyRecipe,
    left_pad,
    sft_loop,
    warmup_cosine,
)

logger = logging.getLogger(__name__)

TOOLS_DIR = PACKAGED_DIR.with_name("builtin_model_tools")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# the tool_arith workflow's defaults (conf/rollout/workflow/tool_arith.yaml): the measurement
# runs the episodes the RL run starts from
MAX_TOOL_CALLS = 8
MAX_EPISODE_TOKENS = 400  # + the longest prompt (95 tokens) < the model's 512 positions


_FAITHFUL_CALL = re.compile(r"(\d)([+-])(\d)=<calc>\(\1\2\3\)%10</calc>")


@dataclass(frozen=True)
class ToolRecipe:
    """The fine-tune on top of the committed base; stored in build.json."""

    # First `format_steps` at `format_tool_rate`: enough calls for the tiny model to learn to write
    # one (the tag, the copied expression, going on after the result); then `steps` at `tool_rate`,
    # where the rate at which it calls settles back to rare. One warm-up + cosine over both.
    format_steps: int = 2400
    format_tool_rate: float = 0.5
    steps: int = 600
    lr: float = 1e-3
    tokens_per_step: int = 512
    tool_rate: float = 0.1  # share of steps that call the calculator, at the end of the fine-tune
    slip_rate: float = TinyRecipe.sft_slip_rate  # the written steps: as in the base's phase 3
    misconception_rate: float = TinyRecipe.misconception_rate
    seed: int = 0
    recipe_version: int = 1


def build_tools_model(out_dir: Path, recipe: ToolRecipe, base: Path = PACKAGED_DIR, threads: int = 1) -> Path:
    """Fine-tune `base` into `out_dir` (its tokenizer copied unchanged), measure it, write build.json."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    t0 = time.time()
    torch.set_num_threads(threads)
    torch.manual_seed(recipe.seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        if (base / name).exists():
            shutil.copy(base / name, out_dir / name)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = Qwen2ForCausalLM.from_pretrained(str(base), torch_dtype=torch.float32)
    rng = random.Random(recipe.seed + 3)
    total = recipe.format_steps + recipe.steps
    lr_at = warmup_cosine(recipe.lr, total)

    def example_at(problem: arith_task.ArithProblem, step: int) -> tuple[list[int], list[int]]:
        rate = recipe.format_tool_rate if step < recipe.format_steps else recipe.tool_rate
        segments, _ = tool_worked_solution(
            problem.start, problem.ops, rng, rate, recipe.slip_rate, recipe.misconception_rate, MAX_TOOL_CALLS
        )
        prompt = tokenizer.encode(problem.prompt, add_special_tokens=False)
        ids, mask = segment_ids(tokenizer, segments)
        return prompt + ids + [tokenizer.eos_token_id], [0] * len(prompt) + mask + [1]

    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    loss = sft_loop(
        model,
        opt,
        recipe.tokens_per_step,
        total,
        lr_at,
        example_at,
        SFT_SEED + 2,
        "warm start (tools)",
    )
    model.eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    info = {
        "recipe": asdict(recipe),
        "base": json.loads((base / "build.json").read_text())["recipe"],
        "sft_final_loss": loss,
        "build_s": time.time() - t0,
        **measure(model, tokenizer),
    }
    (out_dir / "build.json").write_text(json.dumps(info, indent=2))
    logger.info("tool warm start built in %.0fs (loss %.3f) -> %s", info["build_s"], loss, out_dir)
    return out_dir


def measure(model, tokenizer, num_prompts: int = 256) -> dict:
    """The held-out tool_arith numbers and the per-fact beliefs (the misconception must remain)."""
    calls = call_probabilities(model, tokenizer)
    return {
        "tool_heldout": tool_heldout(model, tokenizer, num_prompts),
        "facts": fact_probe.summarize(fact_probe.probe(model, tokenizer)),
        "call_probability": {
            name: sum(p for fact, p in calls.items() if arith_task.is_misconception(*fact) == wanted)
            / sum(arith_task.is_misconception(*fact) == wanted for fact in calls)
            for name, wanted in (("misconception", True), ("other", False))
        },
    }


def call_probabilities(model, tokenizer) -> dict[tuple[int, str, int], float]:
    """Per fact, the probability that the model starts a call where it would write the result
    (after "8+3=" in fact_probe's one-step problem): how often the warm start calls, read off its logits."""
    import torch

    opener = tokenizer.encode(CALL_OPEN, add_special_tokens=False)[0]
    rows = []
    for value, sign, operand in fact_probe.all_facts():
        prompt = f"Q: start {value}; a {sign}{operand}. (mod {arith_task.MODULUS})\nA:"
        prefix = f" {value}; a: {value}{sign}{operand}="
        rows.append(
            tokenizer.encode(prompt, add_special_tokens=False)
            + tokenizer.encode(prefix, add_special_tokens=False)
        )
    out = {}
    with torch.no_grad():
        for fact, row in zip(fact_probe.all_facts(), rows):  # 60 short rows: no padding needed
            logits = model(input_ids=torch.tensor([row])).logits[0, -1].float()
            out[fact] = float(torch.softmax(logits, dim=-1)[opener])
    return out


def tool_heldout(
    model, tokenizer, num_prompts: int = 256, seed: int = 1, max_tool_calls: int = MAX_TOOL_CALLS,
    max_episode_tokens: int = MAX_EPISODE_TOKENS,
) -> dict[str, dict[str, float]]:  # fmt: skip
    """On the held-out stream (data.seed=1): accuracy, mean tool calls per episode and the share of
    episodes with a call, greedy and sampled at temperature 1."""
    import torch

    torch.manual_seed(seed)
    problems = [arith_task.eval_problem_at(seed, i) for i in range(num_prompts)]
    out = {}
    for name, sample in (("greedy", False), ("sampled", True)):
        episodes = []
        for start in range(0, num_prompts, 64):
            chunk = problems[start : start + 64]
            prompts = [tokenizer.encode(p.prompt, add_special_tokens=False) for p in chunk]
            episodes += _tool_episodes(model, tokenizer, prompts, sample, max_tool_calls, max_episode_tokens)
        rewards = [arith_task.reward(text, str(p.answer)).reward for (text, _), p in zip(episodes, problems)]
        calls = [n for _, n in episodes]
        faithful = sum(len(_FAITHFUL_CALL.findall(text)) for text, _ in episodes)
        out[name] = {
            "accuracy": sum(rewards) / num_prompts,
            "tool_calls_per_episode": sum(calls) / num_prompts,
            "episodes_with_calls": sum(n > 0 for n in calls) / num_prompts,
            # calls that compute the step they follow ("8+3=<calc>(8+3)%10</calc>"): the rest are
            # garbled or copy another expression, and their result misleads the chain
            "faithful_calls": faithful / max(1, sum(calls)),
        }
    return out


def _tool_episodes(
    model, tokenizer, prompts: list[list[int]], sample: bool, max_tool_calls: int, max_episode_tokens: int
) -> list[tuple[str, int]]:
    """tool_arith's loop on a batch: (answer text, number of calls) per prompt. Round r generates
    for the rows that made r calls, each stopping after CALL_CLOSE or at the end of its answer."""
    import torch

    eos = tokenizer.eos_token_id
    closers = {i for token, i in tokenizer.get_vocab().items() if token.endswith(">")}
    outputs: list[list[int]] = [[] for _ in prompts]
    calls = [0] * len(prompts)
    active = list(range(len(prompts)))
    for round_index in range(max_tool_calls + 1):
        may_call = round_index < max_tool_calls
        rows = [prompts[i] + outputs[i] for i in active]
        ids, mask = left_pad(rows)
        budget = max(max_episode_tokens - len(outputs[i]) for i in active)
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=budget, do_sample=sample,
                temperature=1.0 if sample else None, top_p=1.0, top_k=0, pad_token_id=eos, eos_token_id=eos,
                stopping_criteria=[_StopAfterCall(tokenizer, closers)] if may_call else None,
            )[:, ids.shape[1] :].tolist()  # fmt: skip
        still = []
        for i, new in zip(active, gen):
            new = new[: max_episode_tokens - len(outputs[i])]
            cut, called = len(new), False
            for j, token in enumerate(new):
                if token == eos:
                    cut = j
                    break
                if may_call and token in closers and tokenizer.decode(new[: j + 1]).endswith(CALL_CLOSE):
                    cut, called = j + 1, True
                    break
            outputs[i] += new[:cut]
            if called:
                calls[i] += 1
                text = tokenizer.decode(new[:cut], skip_special_tokens=True)
                outputs[i] += tokenizer.encode(calculator(expression_of(text)), add_special_tokens=False)
                if len(outputs[i]) < max_episode_tokens:
                    still.append(i)
        active = still
        if not active:
            break
    return [(tokenizer.decode(o, skip_special_tokens=True), n) for o, n in zip(outputs, calls)]


class _StopAfterCall:
    """generate's stopping criterion: a row is done once its text ends with CALL_CLOSE."""

    def __init__(self, tokenizer, closers: set[int]) -> None:
        self.tokenizer, self.closers = tokenizer, closers

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        done = [
            int(row[-1]) in self.closers and self.tokenizer.decode(row[-16:].tolist()).endswith(CALL_CLOSE)
            for row in input_ids
        ]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build or measure the tool-use warm start.")
    parser.add_argument("--out", type=Path, default=TOOLS_DIR, help="HF directory to write")
    parser.add_argument("--base", type=Path, default=PACKAGED_DIR, help="the model to fine-tune")
    parser.add_argument("--measure", type=Path, default=None, help="only measure this model directory")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=256, help="held-out prompts to measure on")
    for name in ("format_steps", "format_tool_rate", "steps", "lr", "tool_rate"):
        kind = type(getattr(ToolRecipe(), name))
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=getattr(ToolRecipe(), name))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.measure is not None:
        import torch

        torch.set_num_threads(args.threads)
        model, tokenizer = fact_probe.load(args.measure)
        print(json.dumps(measure(model, tokenizer, args.prompts), indent=2))
        return 0
    recipe = replace(
        ToolRecipe(), format_steps=args.format_steps, format_tool_rate=args.format_tool_rate, steps=args.steps,
        lr=args.lr, tool_rate=args.tool_rate,
    )  # fmt: skip
    build_tools_model(args.out, recipe, base=args.base, threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
