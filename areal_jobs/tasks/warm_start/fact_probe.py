"""What a policy believes about each arithmetic fact of the built-in task, read off its logits.

A fact is (digit, sign, operand), e.g. (8, "+", 3). The probe gives the policy the one-step problem
"Q: start 8; a +3. (mod 10)\\nA:" and the worked answer up to " 8; a: 8+3=", and reads the
next-token distribution over the ten digits: the probability of the right result, of the
misconception's result (arith_task.misconceived), and the most likely digit (the greedy answer).
This is how the warm start's misconception is checked, and how a run shows it was unlearned:

    python -m areal_jobs.tasks.warm_start.fact_probe areal_jobs/tasks/models/builtin_model runs/<name>/final_hf
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from areal_jobs.tasks import arith_task


@dataclass(frozen=True)
class FactBelief:
    value: int
    sign: str
    operand: int
    p_right: float  # probability of the right result digit
    p_misconceived: float  # probability of the misconception's digit (== p_right off the misconception)
    greedy: int  # the most likely digit

    @property
    def misconception(self) -> bool:
        return arith_task.is_misconception(self.value, self.sign, self.operand)

    @property
    def right(self) -> int:
        return (
            self.value + self.operand if self.sign == "+" else self.value - self.operand
        ) % arith_task.MODULUS


def all_facts() -> list[tuple[int, str, int]]:
    return [
        (value, sign, operand)
        for value in range(arith_task.MODULUS)
        for sign in "+-"
        for operand in range(1, arith_task.MAX_OPERAND + 1)
    ]


def probe(model, tokenizer) -> list[FactBelief]:
    """One FactBelief per fact (60), from one batched forward pass."""
    import torch

    digit_ids = [tokenizer.encode(str(d), add_special_tokens=False) for d in range(arith_task.MODULUS)]
    assert all(len(ids) == 1 for ids in digit_ids), "the tokenizer must keep digits single tokens"
    digit_ids = [ids[0] for ids in digit_ids]
    rows = []
    for value, sign, operand in all_facts():
        prompt = f"Q: start {value}; a {sign}{operand}. (mod {arith_task.MODULUS})\nA:"
        prefix = f" {value}; a: {value}{sign}{operand}="
        # prompt and answer tokenised apart, as generation sees them (see tiny_model.sft_example)
        rows.append(
            tokenizer.encode(prompt, add_special_tokens=False)
            + tokenizer.encode(prefix, add_special_tokens=False)
        )
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):  # left padding: the last position is every row's next token
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -1].float()
    probs = torch.softmax(logits, dim=-1)[:, digit_ids]  # mass on the ten digits
    out = []
    for (value, sign, operand), p in zip(all_facts(), probs.tolist()):
        right = (value + operand if sign == "+" else value - operand) % arith_task.MODULUS
        wrong = arith_task.misconceived(value, sign, operand)
        out.append(
            FactBelief(value, sign, operand, p[right], p[wrong], max(range(len(p)), key=p.__getitem__))
        )
    return out


def summarize(beliefs: list[FactBelief]) -> dict[str, dict[str, float]]:
    """Greedy accuracy and mean probabilities, on the misconception facts and on the others."""
    out = {}
    for name, chosen in (
        ("misconception", [b for b in beliefs if b.misconception]),
        ("other", [b for b in beliefs if not b.misconception]),
    ):
        n = max(len(chosen), 1)
        out[name] = {
            "facts": len(chosen),
            "greedy_right": sum(b.greedy == b.right for b in chosen) / n,
            "p_right": sum(b.p_right for b in chosen) / n,
            "p_misconceived": sum(b.p_misconceived for b in chosen) / n,
        }
    return out


def load(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the architecture of the checkpoint's config.json: the dense built-in models and the tiny MoE
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype="float32").eval()
    return model, AutoTokenizer.from_pretrained(str(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Per-fact beliefs of built-in-task policies.")
    parser.add_argument("models", nargs="+", type=Path, help="HF directories (warm start, final_hf, ...)")
    args = parser.parse_args(argv)
    for path in args.models:
        beliefs = probe(*load(path))
        print(f"== {path}")
        for name, row in summarize(beliefs).items():
            print(
                f"  {name:13s} facts={row['facts']:2d} greedy_right={row['greedy_right']:.2f} "
                f"p_right={row['p_right']:.2f} p_misconceived={row['p_misconceived']:.2f}"
            )
        wrong = [f"{b.value}{b.sign}{b.operand}={b.greedy}" for b in beliefs if b.greedy != b.right]
        print(f"  greedy wrong on: {' '.join(wrong) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
