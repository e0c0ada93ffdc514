"""algo.prox_logp A/B: TorchBackend.train_step per mode on the built-in model, interleaved, one process.

    python -m bench.staleness.prox_logp_bench [rounds]      # default 12 rounds x 3 modes, ~2 min on 2 cores

A fixed batch shaped like the built-in task's 60-step runs (64 samples, ~2600 output tokens, every
token 3 versions old). Reports wall and CPU seconds per step: the CPU time of one single-threaded
process barely moves with the machine's load, which swamps wall-clock differences on a shared box.
"""

from __future__ import annotations

import statistics as st
import sys
import time

import numpy as np
import torch

from areal_jobs.config import AlgoConfig, DType, TrainerConfig
from areal_jobs.config.algo import ProxLogp
from areal_jobs.trainer.intake.batch import TrainBatch, TrainSample
from areal_jobs.trainer.torch.backend import TorchBackend

MODEL = "areal_jobs/tasks/models/builtin_model"
MODES = [ProxLogp.recompute, ProxLogp.loglinear, ProxLogp.current]


def make_batch(seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(64):
        p, o = int(rng.integers(15, 30)), int(rng.integers(10, 72))
        samples.append(
            TrainSample(
                sample_id=f"g{i // 8}/{i % 8}",
                input_ids=rng.integers(1, 60, p + o),
                num_prompt_tokens=p,
                behav_logprobs=np.full(o, -2.0, np.float32),
                versions=np.full(o, 7, np.int32),
                advantage=float(rng.normal()),
                reward=0.0,
            )
        )
    return TrainBatch(version=10, samples=samples, group_ids=[f"g{i}" for i in range(8)])


def run(rounds: int = 12) -> dict[str, float]:
    torch.set_num_threads(1)
    batch = make_batch()
    backends = {}
    for mode in MODES:
        cfg = TrainerConfig(max_tokens_per_microbatch=1024)
        backend = TorchBackend(cfg, AlgoConfig(decoupled=True, prox_logp=mode), MODEL, DType.float32)
        backend.setup()
        backend.train_step(batch)  # warm-up
        backends[mode] = backend
    wall: dict[ProxLogp, list[float]] = {m: [] for m in MODES}
    cpu: dict[ProxLogp, list[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:  # alternate the order against drifts
            c0 = time.process_time()
            wall[mode].append(backends[mode].train_step(batch)["time/train_s"])
            cpu[mode].append(time.process_time() - c0)
    out = {"output_tokens": float(batch.num_output_tokens)}
    for mode in MODES:
        out[f"{mode.value}/wall_s_median"] = st.median(wall[mode])
        out[f"{mode.value}/cpu_s_median"] = st.median(cpu[mode])
        out[f"{mode.value}/cpu_vs_recompute"] = st.median(cpu[mode]) / st.median(cpu[ProxLogp.recompute])
    return out


if __name__ == "__main__":
    for key, value in run(int(sys.argv[1]) if len(sys.argv) > 1 else 12).items():
        print(f"{key}: {value:.3f}")
