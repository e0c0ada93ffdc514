"""What the offpolicy/* metrics cost per train step (trainer/loss_stats.py), measured side by side.

    python -m bench.offpolicy_cost            # 12 rounds, the built-in model, make run's batch shape

One process, the torch backend on the committed warm start, one batch of B x G = 64 answers
whose behaviour log-probs are the model's own shifted by noise (so tokens are pre-clipped and the
histogram is filled). Rounds alternate: a train step with the statistics (the default) and one
without (`pre_step_logp` returning None, so `offpolicy_sums` is skipped), each from the same
weights; CPU seconds per step (time.process_time: the machine's load barely moves them). Prints
the median of each and their ratio, and the statistics alone on 64k tokens.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]


def make_batch(model, rng: np.random.Generator):
    from areal_jobs.data import arith_task
    from areal_jobs.data.tokenizer import load_tokenizer
    from areal_jobs.trainer.batch import TrainBatch, TrainSample
    from areal_jobs.trainer.hf_logprobs import token_logprobs

    tok = load_tokenizer(str(REPO / "areal_jobs" / "data" / "builtin_model"))
    samples = []
    for i in range(64):
        p = arith_task.problem_at(1, i // 8)
        prompt, answer = tok.encode(p.prompt), tok.encode(p.solution)
        ids = np.asarray(prompt + answer, np.int64)
        samples.append(TrainSample(f"g{i // 8}/{i % 8}", ids, len(prompt), np.zeros(len(answer), np.float32),
                                   np.zeros(len(answer), np.int32), float(rng.normal()), 0.0))  # fmt: skip
    with torch.no_grad():
        own = token_logprobs(model, samples)
    for s, lp in zip(samples, own, strict=True):
        s.behav_logprobs[:] = lp.numpy() + rng.normal(0.0, 0.3, size=lp.shape[0]).astype(np.float32)
    return TrainBatch(version=1, samples=samples, group_ids=[f"g{i}" for i in range(8)])


def main(argv: list[str] | None = None) -> int:
    from areal_jobs.config import AlgoConfig, DType, TrainerConfig
    from areal_jobs.trainer import torch_backend
    from areal_jobs.trainer.loss_stats import offpolicy_from_host, offpolicy_sums
    from areal_jobs.trainer.torch_backend import TorchBackend

    p = argparse.ArgumentParser(prog="python -m bench.offpolicy_cost", description=__doc__.split("\n")[0])
    p.add_argument("rounds", type=int, nargs="?", default=12)
    p.add_argument("--minibatches", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    backend = TorchBackend(TrainerConfig(), AlgoConfig(ppo_minibatches=args.minibatches),
                           str(REPO / "areal_jobs" / "data" / "builtin_model"), DType.float32)  # fmt: skip
    backend.setup()
    start = copy.deepcopy(backend.model.state_dict())
    batch = make_batch(backend.model, np.random.default_rng(0))
    real = torch_backend.pre_step_logp
    times: dict[str, list[float]] = {"with": [], "without": []}
    for i in range(2 * args.rounds + 2):
        mode = "with" if i % 2 == 0 else "without"
        torch_backend.pre_step_logp = real if mode == "with" else (lambda *a, **k: None)
        backend.model.load_state_dict(start)
        t0 = time.process_time()
        backend.train_step(batch)
        if i >= 2:  # the first round of each warms caches
            times[mode].append(time.process_time() - t0)
    torch_backend.pre_step_logp = real
    with_s, without_s = statistics.median(times["with"]), statistics.median(times["without"])
    n = 65_536
    pre, behav = torch.randn(n).mul(0.3) - 2.0, torch.full((n,), -2.0)
    adv, mask = torch.randn(n), torch.ones(n)
    t0 = time.process_time()
    for _ in range(10):
        offpolicy_from_host(offpolicy_sums(pre, behav, adv, mask, 0.2, 0.2, 20.0).cpu().numpy())
    alone = (time.process_time() - t0) / 10
    tokens = batch.num_output_tokens
    print(
        f"train step ({tokens} output tokens, {args.minibatches} minibatch(es)), CPU s, median of {args.rounds}:"
    )
    print(f"  with offpolicy/* {with_s:.4f}  without {without_s:.4f}  ratio {with_s / without_s:.4f} "
          f"({1000 * (with_s - without_s):+.1f} ms per step)")  # fmt: skip
    print(f"  offpolicy_sums alone on {n} tokens: {1000 * alone:.1f} ms ({1e9 * alone / n:.0f} ns per token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
