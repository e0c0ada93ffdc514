"""Fault model: what server and node failures cost a run, with self-healing rollout servers against
today's SLURM behaviour (any dead task ends the job, which is requeued and resumes from the last
checkpoint).

Failures are Poisson, at one rate per GPU (`gpu_mtbf_h`, all causes). A share of them
(`restartable_share`: software crashes, OOM, transient Xid) is fixed by restarting the process in
place; the rest (GPU, HBM, host, network hardware) take the node out until it is replaced.

Kill-and-requeue: a failure anywhere among the job's GPUs ends it. Each interruption costs the
requeue wait and the start-up (`requeue_wait_s + startup_s`) plus the work since the last
checkpoint. Self-healing: only a trainer-side failure ends the job (the trainer group keeps
checkpoint-restart semantics; the controller runs on a trainer node); a rollout failure costs that
server `server_restart_s`, or that node's servers `node_replace_s`, of capacity while the trainer
goes on.

Useful share of wall time with job-level failure rate L, downtime D per failure and checkpoints
every tau seconds of running (renewal-reward, exact for exponential failures): the job runs
X ~ Exp(L) and keeps tau * floor(X / tau) of it, E[floor(X / tau)] = q / (1 - q), q = exp(-L tau):
    useful = tau q / (1 - q) / (1 / L + D)          (~ 1 - L (tau / 2 + D) when L small)
Lost rollout capacity is charged linearly (throughput proportional to live servers): exact when
generation is the bottleneck, an overestimate of the loss when the trainer is (the paper's setting),
so the self-healing numbers are a lower bound. Pure: numbers in, numbers out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Llama 3 (arXiv 2407.21783, section 3.3.4): 419 unexpected interruptions in 54 days on 16,384 H100s,
# ~78% of them confirmed or suspected hardware. Per GPU: 16,384 * 54 * 24 / 419 = 50,700 GPU-hours.
LLAMA3_GPU_MTBF_H = 16_384 * 54 * 24 / 419
LLAMA3_RESTARTABLE_SHARE = 0.22


@dataclass(frozen=True)
class FaultModel:
    gpu_mtbf_h: float = LLAMA3_GPU_MTBF_H  # hours between failures of one GPU (host share included)
    restartable_share: float = LLAMA3_RESTARTABLE_SHARE  # failures a restart in place fixes
    server_restart_s: float = 180.0  # a crashed server: start, load weights, first sync, takes work
    node_replace_s: float = 4 * 3600.0  # a failed rollout node's servers are gone this long (drain, replace)
    requeue_wait_s: float = 900.0  # a requeued job waits this long in the queue for its nodes
    startup_s: float = 600.0  # allocation to first step: servers up, checkpoint loaded, first sync
    checkpoint_interval_s: float = 2700.0  # running time between checkpoints (checkpoint.every_steps x step)

    def __post_init__(self) -> None:
        if self.gpu_mtbf_h <= 0:
            raise ValueError("faults.gpu_mtbf_h must be > 0")
        if not 0.0 <= self.restartable_share <= 1.0:
            raise ValueError("faults.restartable_share must be in [0, 1]")
        times = (self.server_restart_s, self.node_replace_s, self.requeue_wait_s, self.startup_s)
        if min(times) < 0 or self.checkpoint_interval_s <= 0:
            raise ValueError(
                "faults.server_restart_s, node_replace_s, requeue_wait_s, startup_s must be >= 0 "
                "and faults.checkpoint_interval_s > 0"
            )

    @property
    def gpu_rate_per_s(self) -> float:
        return 1.0 / (self.gpu_mtbf_h * 3600.0)

    @property
    def recovery_s(self) -> float:
        """Downtime of one kill-and-requeue, before the lost work since the checkpoint."""
        return self.requeue_wait_s + self.startup_s


def useful_share(rate_per_s: float, down_s: float, checkpoint_s: float) -> float:
    """Share of wall time that ends up as kept training, for job-level failure rate `rate_per_s`."""
    if rate_per_s <= 0:
        return 1.0
    q = math.exp(-rate_per_s * checkpoint_s)
    kept_per_cycle = checkpoint_s * q / (1.0 - q) if q < 1.0 else 1.0 / rate_per_s
    return kept_per_cycle / (1.0 / rate_per_s + down_s)


def monte_carlo_useful_share(
    rate_per_s: float, down_s: float, checkpoint_s: float, horizon_s: float, seed: int = 0
) -> float:
    """The same share by drawing failures (fixed seed): a check of `useful_share`, not a substitute."""
    rng = np.random.default_rng(seed)
    t = kept = 0.0
    while t < horizon_s:
        up = rng.exponential(1.0 / rate_per_s)
        kept += checkpoint_s * math.floor(up / checkpoint_s)
        t += up + down_s
    return kept / t


def server_down_share(m: FaultModel, gpus_per_server: int, gpus_per_node: int) -> float:
    """Long-run share of rollout servers down under self-healing (alternating renewal per server:
    restartable failures of its own GPUs, hardware failures of any GPU of its node)."""
    own = gpus_per_server * m.gpu_rate_per_s * m.restartable_share * m.server_restart_s
    node = gpus_per_node * m.gpu_rate_per_s * (1.0 - m.restartable_share) * m.node_replace_s
    return (own + node) / (1.0 + own + node)


@dataclass(frozen=True)
class FaultOutcome:
    gpu_mtbf_h: float
    job_interruptions_per_day_requeue: float  # kill-and-requeue: failures anywhere
    job_interruptions_per_day_healing: float  # self-healing: trainer-side failures only
    server_restarts_per_day: float  # self-healing: servers restarted in place
    node_losses_per_day: float  # self-healing: rollout nodes drained and replaced
    useful_requeue: float  # share of wall time kept, kill-and-requeue
    useful_healing: float  # same, self-healing, times the live rollout capacity
    servers_down_mean: float  # self-healing: servers down on average
    tokens_per_s_requeue: float
    tokens_per_s_healing: float
    steps_per_h_requeue: float
    steps_per_h_healing: float

    @property
    def gain(self) -> float:
        return self.tokens_per_s_healing / self.tokens_per_s_requeue


def compare(
    m: FaultModel,
    *,
    rollout_gpus: int,
    trainer_gpus: int,
    gpus_per_server: int,
    gpus_per_node: int,
    tokens_per_s: float,
    step_s: float,
) -> FaultOutcome:
    """Self-healing against kill-and-requeue for one cluster; `tokens_per_s` and `step_s` are the
    failure-free throughput and step time (from the simulator)."""
    day = 86_400.0
    servers = rollout_gpus // gpus_per_server
    rate_all = (rollout_gpus + trainer_gpus) * m.gpu_rate_per_s
    rate_trainer = trainer_gpus * m.gpu_rate_per_s
    requeue = useful_share(rate_all, m.recovery_s, m.checkpoint_interval_s)
    down = server_down_share(m, gpus_per_server, gpus_per_node)
    healing = useful_share(rate_trainer, m.recovery_s, m.checkpoint_interval_s) * (1.0 - down)
    return FaultOutcome(
        gpu_mtbf_h=m.gpu_mtbf_h,
        job_interruptions_per_day_requeue=rate_all * day,
        job_interruptions_per_day_healing=rate_trainer * day,
        server_restarts_per_day=rollout_gpus * m.gpu_rate_per_s * m.restartable_share * day,
        node_losses_per_day=rollout_gpus * m.gpu_rate_per_s * (1.0 - m.restartable_share) * day,
        useful_requeue=requeue,
        useful_healing=healing,
        servers_down_mean=down * servers,
        tokens_per_s_requeue=tokens_per_s * requeue,
        tokens_per_s_healing=tokens_per_s * healing,
        steps_per_h_requeue=3600.0 / step_s * requeue,
        steps_per_h_healing=3600.0 / step_s * healing,
    )
