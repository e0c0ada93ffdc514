"""What the offpolicy/* metrics cost per train step (trainer/objective/loss_stats.py), measured side by side.

    python -m bench.staleness.offpolicy_cost            # 12 rounds, the built-in model, make run's batch shape
    python -m bench.staleness.offpolicy_cost --objectives-only 6   # issue 42: each algo.objective's step only

One process, the torch backend on the committed warm start, one batch of B x G = 64 answers
whose behaviour log-probs are the model's own shifted by noise (so tokens are pre-clipped and the
histogram is filled). Rounds alternate: a train step with the statistics (the default) and one
without (`pre_step_logp` returning None, so `offpolicy_sums` is skipped), each from the same
weights; CPU seconds per step (time.process_time: the machine's load barely moves them). Prints
the median of each and their ratio, and the statistics alone on 64k tokens.

Then each objective of issue 42 (OBJECTIVES: algo.objective, and decoupled with algo.ess_step=sqrt)
on the same batch from the same weights, round-robin so that load drifts hit every arm alike:
the median CPU seconds of a train step and its ratio to the decoupled default's.
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

REPO = Path(__file__).resolve().parents[2]


def make_batch(model, rng: np.random.Generator):
    from areal_jobs.data.tokenizer import load_tokenizer
    from areal_jobs.tasks import arith_task
    from areal_jobs.trainer.forward.hf_logprobs import token_logprobs
    from areal_jobs.trainer.intake.batch import TrainBatch, TrainSample

    tok = load_tokenizer(str(REPO / "areal_jobs" / "tasks" / "models" / "builtin_model"))
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


# arm -> AlgoConfig overrides (issue 42's objectives; decoupled, the default until issue 42, is
# the reference the committed ratios were measured against)
OBJECTIVES = {
    "decoupled": {"objective": "decoupled"},
    "ppo": {"objective": "ppo"},
    "icepop": {"objective": "icepop"},
    "m2po": {"objective": "m2po"},
    "m2po_areal": {"objective": "m2po_areal"},
    "prime": {"objective": "prime"},
    "cispo": {"objective": "cispo"},
    "decoupled+ess": {"objective": "decoupled", "ess_step": "sqrt"},
}


def objective_costs(backend, start: dict, batch, rounds: int, minibatches: int) -> dict[str, float]:
    """Median CPU seconds of one train step per OBJECTIVES arm (the backend's algo swapped per
    step, the weights reset to `start` before each); the first round warms caches."""
    from dataclasses import replace

    from areal_jobs.config import AlgoConfig
    from areal_jobs.trainer.objective.objectives import set_lr_scale

    algos = {name: replace(AlgoConfig(ppo_minibatches=minibatches), **o) for name, o in OBJECTIVES.items()}
    times: dict[str, list[float]] = {name: [] for name in OBJECTIVES}
    for i in range(rounds + 1):
        for name, algo in algos.items():
            backend.algo = algo
            backend.model.load_state_dict(start)
            t0 = time.process_time()
            backend.train_step(batch)
            if i >= 1:
                times[name].append(time.process_time() - t0)
            set_lr_scale(backend.optimizer, 1.0)  # ess_step left its lr scaled
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    from areal_jobs.config import AlgoConfig, DType, TrainerConfig
    from areal_jobs.trainer.objective.loss_stats import offpolicy_from_host, offpolicy_sums
    from areal_jobs.trainer.torch import backend as torch_backend
    from areal_jobs.trainer.torch.backend import TorchBackend

    p = argparse.ArgumentParser(
        prog="python -m bench.staleness.offpolicy_cost", description=__doc__.split("\n")[0]
    )
    p.add_argument("rounds", type=int, nargs="?", default=12)
    p.add_argument("--minibatches", type=int, default=1)
    p.add_argument("--objectives-only", type=int, default=0, metavar="ROUNDS",
                   help="skip the offpolicy/* comparison; time each objective over ROUNDS rounds")  # fmt: skip
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    backend = TorchBackend(TrainerConfig(), AlgoConfig(ppo_minibatches=args.minibatches),
                           str(REPO / "areal_jobs" / "tasks" / "models" / "builtin_model"), DType.float32)  # fmt: skip
    backend.setup()
    start = copy.deepcopy(backend.model.state_dict())
    batch = make_batch(backend.model, np.random.default_rng(0))
    if args.objectives_only:
        print_objective_costs(backend, start, batch, args.objectives_only, args.minibatches)
        return 0
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
    print_objective_costs(backend, start, batch, args.rounds, args.minibatches)
    return 0


def print_objective_costs(backend, start, batch, rounds: int, minibatches: int) -> None:
    costs = objective_costs(backend, start, batch, rounds, minibatches)
    ref = costs["decoupled"]
    print(f"train step per objective ({batch.num_output_tokens} output tokens, {minibatches} minibatch(es)), "
          f"CPU s, median of {rounds}, ratio to decoupled:")  # fmt: skip
    for name, secs in costs.items():
        print(f"  {name:14s} {secs:.4f}  {secs / ref:.3f}")


if __name__ == "__main__":
    sys.exit(main())
