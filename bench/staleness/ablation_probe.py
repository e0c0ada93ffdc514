"""The cheap check before the staleness ablation: can naive and decoupled PPO separate at all?

    python -m bench.staleness.ablation_probe                                   # countdown warm start, lr 1e-3
    python -m bench.staleness.ablation_probe --lrs 3e-4,1e-3 --delays 0,2,8,32 --minibatches 4

On the torch backend, without servers: a batch B_0 is sampled from the warm start θ_0 (Hugging
Face generate at temperature 1, behaviour log-probs from the same weights), then the policy takes
on-policy RL steps (a fresh batch from the current policy each step, `TorchBackend.train_step`
with the run's objective) and, after d steps for each delay d, the first minibatch of B_0 is
scored at θ_d: the gradient of the naive objective (clip around b), of decoupled PPO with the
behaviour weight capped at 5, and without a cap, all at the pre-step weights, and their cosines,
beside the offpolicy/* statistics of that minibatch (trainer/objective/loss_stats.py). Where no token is
pre-clipped (and none capped) the gradients are the same and the cosine is 1: if it stays above
~0.99 at a delay, the two arms cannot separate there (docs/objective.md, "How much staleness").
Writes <out>/probe.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "areal_jobs" / "tasks" / "models" / "builtin_model_countdown"


def sample_batch(model, tokenizer, problems, version: int, group_size: int, max_new_tokens: int, algo):
    """One TrainBatch of `problems` x group_size answers sampled from `model` at temperature 1,
    scored by the countdown verifier, advantages as the trainer computes them (trainer/intake/batch.py)."""
    from areal_jobs.reward.countdown import reward_countdown
    from areal_jobs.tasks.warm_start.tiny_model import left_pad
    from areal_jobs.trainer.forward.hf_logprobs import token_logprobs
    from areal_jobs.trainer.intake.batch import TrainSample, assemble
    from areal_jobs.transport import messages as m

    groups = []
    for gi, p in enumerate(problems):
        prompt = tokenizer.encode(p.prompt, add_special_tokens=False)
        ids, mask = left_pad([prompt] * group_size)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=True,
                temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0, eos_token_id=0,
            )  # fmt: skip
        answers = []
        for row in out[:, ids.shape[1] :].tolist():
            end = row.index(0) + 1 if 0 in row else len(row)  # keep the EOS token, as a server returns it
            answers.append(np.asarray(row[:end], dtype=np.int32))
        stand_ins = [
            TrainSample("", np.asarray(prompt + a.tolist(), np.int64), len(prompt), np.zeros(len(a), np.float32),
                        np.zeros(len(a), np.int32), 0.0, 0.0)
            for a in answers
        ]  # fmt: skip
        with torch.no_grad():
            behav = token_logprobs(model, stand_ins)
        samples = tuple(
            m.SampleTrajectory(
                sample_id=f"g{gi}/{i}", output_ids=a, logprobs=b.numpy().astype(np.float32),
                versions=np.full(len(a), version, np.int32),
                reward=reward_countdown(tokenizer.decode(a.tolist(), skip_special_tokens=True), p.reference).reward,
                reward_status="ok", finish_reason="stop" if a[-1] == 0 else "length", num_interruptions=0,
            )
            for i, (a, b) in enumerate(zip(answers, behav, strict=True))
        )  # fmt: skip
        groups.append(m.TrajectoryGroup(f"g{gi}", gi, np.asarray(prompt, np.int32), samples))
    return assemble(groups, version, algo, max_new_tokens)


def gradient_cosines(backend, batch) -> dict[str, float]:
    """Naive, decoupled (cap 5) and decoupled (no cap) gradients of the batch's first minibatch
    at the backend's current weights; their cosines and the minibatch's offpolicy/* statistics."""
    from areal_jobs.config.algo import BehavWeightMode
    from areal_jobs.trainer.forward.hf_logprobs import token_logprobs
    from areal_jobs.trainer.intake.minibatches import loss_inputs, split_minibatches, step_weights
    from areal_jobs.trainer.objective.loss import LossStats, ppo_loss

    model, algo = backend.model, backend.algo
    first = split_minibatches(batch.samples, algo)[0]
    samples = [batch.samples[i] for i in first]
    agg = step_weights(batch.samples, first, algo, batch.max_new_tokens)
    inputs = loss_inputs(samples, [agg[i] for i in first])
    behav = torch.cat([torch.from_numpy(s.behav_logprobs) for s in samples])
    arms = {
        "naive": replace(algo, decoupled=False),
        "decoupled_cap5": replace(algo, decoupled=True, behav_weight_mode=BehavWeightMode.drop, behav_weight_cap=5.0),
        "decoupled_nocap": replace(algo, decoupled=True, behav_weight_mode=BehavWeightMode.drop, behav_weight_cap=0.0),
    }  # fmt: skip
    grads, stats = {}, LossStats()
    for name, arm in arms.items():
        model.zero_grad(set_to_none=True)
        logp = torch.cat(token_logprobs(model, samples, temperature=backend.temperature))
        prox = behav if name == "naive" else logp.detach()
        loss, s = ppo_loss(logp, prox, behav, **inputs, algo=arm, pre_logp=logp.detach())
        loss.backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        if name == "naive":
            stats = s
    model.zero_grad(set_to_none=True)

    def cos(a, b):  # nan, not 0, where a gradient is zero (every group's rewards equal: no signal)
        if not (a.abs().sum() > 0 and b.abs().sum() > 0):
            return float("nan")
        return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))

    metrics = stats.to_metrics()
    return {
        "cos_naive_decoupled_cap5": cos(grads["naive"], grads["decoupled_cap5"]),
        "cos_naive_decoupled_nocap": cos(grads["naive"], grads["decoupled_nocap"]),
        "cos_cap5_nocap": cos(grads["decoupled_cap5"], grads["decoupled_nocap"]),
        "grad_norm_naive": float(grads["naive"].norm()),
        "grad_norm_decoupled_cap5": float(grads["decoupled_cap5"].norm()),
        **{k.removeprefix("offpolicy/"): v for k, v in metrics.items() if k.startswith("offpolicy/")},
    }


def probe(args: argparse.Namespace, lr: float) -> list[dict]:
    """One policy trajectory at learning rate `lr`: rows per delay (B_0 scored at θ_d)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from areal_jobs.config import AlgoConfig, DType, TrainerConfig
    from areal_jobs.tasks import countdown_task
    from areal_jobs.trainer.torch.backend import TorchBackend

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    algo = AlgoConfig(
        batch_size=args.batch_size, group_size=args.group_size, ppo_minibatches=args.minibatches,
        max_staleness=max(args.delays), behav_weight_cap=5.0,
    )  # fmt: skip
    trainer = TrainerConfig(lr=lr, seed=args.seed, max_tokens_per_microbatch=4096)
    backend = TorchBackend(trainer, algo, str(args.model), DType.float32)
    backend.setup()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(args.model))
    # the trainer's model attends within one packed row (varlen): generate with an sdpa copy
    sampler = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32).eval()
    stream = (countdown_task.problem_at(args.data_seed, i) for i in range(10**9))

    def next_batch(version: int):
        sampler.load_state_dict(backend.model.state_dict())
        problems = [next(stream) for _ in range(args.batch_size)]
        return sample_batch(sampler, tokenizer, problems, version, args.group_size, args.max_new_tokens, algo)

    stale = next_batch(0)
    rows, t0 = [], time.monotonic()
    for step in range(max(args.delays) + 1):
        if step in args.delays:
            row = {"lr": lr, "delay": step, **gradient_cosines(backend, replace(stale, version=step))}
            rows.append(row)
            print(
                f"lr {lr:g} delay {step:3d}: cos(naive, cap5) {row['cos_naive_decoupled_cap5']:.4f} "
                f"cos(naive, nocap) {row['cos_naive_decoupled_nocap']:.4f} preclip {row['preclip_fraction']:.3f} "
                f"cut {row['preclip_cut_fraction']:.3f} |log w| p99 {row['abs_log_w_p99']:.3f} "
                f"({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
        if step < max(args.delays):
            backend.train_step(next_batch(step))
    return rows


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.staleness.ablation_probe", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--lrs", type=_floats, default=[1e-3])
    p.add_argument("--delays", type=_ints, default=[0, 2, 8, 32])
    p.add_argument("--minibatches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8, help="prompt groups per batch")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data-seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "bench")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [row for lr in args.lrs for row in probe(args, lr)]
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (args.out / "probe.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    print(probe_markdown(rows))
    return 0


def probe_markdown(rows: list[dict]) -> str:
    lines = [
        "| lr | delay | cos(naive, decoupled cap 5) | cos(naive, no cap) | pre-clipped | A>0 | A<0 | cut by naive's clip | |log w| p99 | ESS |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['lr']:g} | {r['delay']} | {r['cos_naive_decoupled_cap5']:.4f} | {r['cos_naive_decoupled_nocap']:.4f} "
            f"| {r['preclip_fraction']:.3f} | {r['preclip_fraction_adv_pos']:.3f} | {r['preclip_fraction_adv_neg']:.3f} "
            f"| {r['preclip_cut_fraction']:.3f} | {r['abs_log_w_p99']:.3f} | {r['ess']:.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
