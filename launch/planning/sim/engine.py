"""The discrete-event schedules: asynchronous (the project's rules) and the synchronous baselines.

Asynchronous (`run_async`), event by event, as the controller and trainer behave:
  admission  `StalenessManager.try_admit(version)` (the controller's own object, same bound and
             same max_running = max_concurrent // G); an admitted group sends G requests to the
             least-loaded servers; its oldest token carries the version it was admitted under.
  batching   once B groups are buffered, `split_fresh` (the trainer's own rule) sends expired
             groups back (`on_expired`, regenerated from the same prompt) and the trainer takes the
             B fresh groups with the oldest tokens first, as TrainLoop.take_groups does.
  training   DP shares from `balanced_microbatches` (as the Megatron backend's plan): the step
             lasts as long as the most loaded trainer GPU, then the weight update (`sync_s`: the
             constant trainer.weight_sync_s, or the phase model of weights.*, full or delta)
             during which every server is paused; then version += 1 and admission resumes.
  auto       algo.staleness_auto: each trained batch's drift (SimProfile.drift: linear in its mean
             lag) goes through the controller's law (areal_jobs/staleness_bound.py), which sets the
             StalenessManager's bound; freshness keeps the ceiling (max_staleness), as the trainer.
Synchronous (`run_sync`) is an explicit barrier loop: admit B groups, generate all, train, sync.
With eta = 0 the asynchronous schedule must reproduce it (a unit test checks this).
Colocated synchronous runs the same barrier loop with every GPU generating, then every GPU training.

Throughput counts output tokens of trained samples (as the trainer's throughput/trained_tokens_per_s)
over the measured steps, after `run.warmup_steps` steps that fill the pipeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from areal_jobs.staleness import StalenessManager
from areal_jobs.staleness_bound import BoundParams, StalenessBoundLaw
from areal_jobs.trainer.intake.batch import split_fresh
from areal_jobs.trainer.intake.packing import balanced_microbatches
from launch.planning.sim.farm import ServerFarm
from launch.planning.sim.profile import LengthModel, SimProfile, TrainerSpeed


@dataclass
class SimGroup:
    """A prompt group in flight: duck-types the `oldest_version` that `split_fresh` reads."""

    key: int
    data_index: int
    attempt: int
    oldest_version: int
    lengths: list[int]
    remaining: int = 0

    @property
    def output_tokens(self) -> int:
        return sum(self.lengths)


@dataclass
class SimResult:
    mode: str  # "async" | "sync" | "colocated"
    max_staleness: int
    gpus: int
    rollout_gpus: int
    trainer_gpus: int
    tokens_per_s: float  # trained output tokens per second, measured steps only
    step_s: float
    gen_s: float  # per step: waiting for the batch (async) or the generation phase (sync)
    train_s: float  # per step: training + weight sync
    expired_groups: int = 0
    staleness_mean: float = 0.0
    staleness_max: int = 0
    rollout_busy: float = 0.0  # share of server-seconds with work to do (measured window)
    extra: dict[str, float] = field(default_factory=dict)
    drift_mean: float = 0.0  # the modelled drift (SimProfile.drift) of the measured steps' batches
    # algo.staleness_auto: the bound in force after each step (every step, warm-up included)
    bounds: list[int] = field(default_factory=list)


def group_lengths(
    lengths: LengthModel, group_size: int, seed: int, data_index: int, attempt: int
) -> list[int]:
    """Answer lengths of one prompt: a pure function of (seed, prompt, attempt), so every schedule
    (and every rollout fraction) sees the same workload."""
    rng = np.random.default_rng((seed, data_index, attempt))
    mu = math.log(lengths.median_tokens) + lengths.prompt_sigma * rng.standard_normal()
    raw = np.exp(mu + lengths.sample_sigma * rng.standard_normal(group_size))
    return np.clip(np.rint(raw), lengths.min_tokens, lengths.max_tokens).astype(int).tolist()


def farm_drift(p: SimProfile, batch: list[SimGroup], version: int) -> float:
    """The drift measure the trainer would report for `batch` trained at `version`."""
    lag = float(np.mean([version - g.oldest_version for g in batch])) if batch else 0.0
    return p.drift.at(lag, p.run.seed, version)


def auto_law(p: SimProfile) -> StalenessBoundLaw | None:
    """algo.staleness_auto: the controller's law (areal_jobs/staleness_bound.py), ceiling = max_staleness."""
    a = p.algo
    if not a.staleness_auto:
        return None
    return StalenessBoundLaw(
        BoundParams(
            ceiling=a.max_staleness,
            target=a.staleness_drift_target,
            raise_below=a.staleness_raise_below,
            hold_steps=a.staleness_hold_steps,
            window_steps=a.staleness_window_steps,
            floor=a.staleness_floor,
        )  # fmt: skip
    )


def train_time_s(groups: list[SimGroup], prompt_tokens: int, trainer_gpus: int, speed: TrainerSpeed) -> float:
    """Forward/backward time of one batch: the most loaded DP rank's tokens over one GPU's speed."""
    seqs = [prompt_tokens + n for g in groups for n in g.lengths]
    shares = balanced_microbatches(seqs, max(sum(seqs), 1), min_count=trainer_gpus)
    busiest = max(sum(seqs[i] for i in share) for share in shares)
    return speed.step_overhead_s + busiest / speed.tokens_per_s_per_gpu


class _Meter:
    """Per-step bookkeeping shared by the schedules; the window opens after the warm-up steps."""

    def __init__(self, p: SimProfile) -> None:
        self.p = p
        self.drift = 0.0  # the last step's modelled drift
        self.warmup, self.total = p.run.warmup_steps, p.run.warmup_steps + p.run.measure_steps
        self.steps = 0
        self.t0 = 0.0
        self.busy0 = 0.0
        self.tokens = 0
        self.gen_s: list[float] = []
        self.train_s: list[float] = []
        self.lags: list[int] = []
        self.drifts: list[float] = []

    @property
    def done(self) -> bool:
        return self.steps >= self.total

    def step(
        self,
        t_end: float,
        farm: ServerFarm,
        batch: list[SimGroup],
        version: int,
        gen_s: float,
        train_s: float,
    ):
        self.steps += 1
        self.drift = farm_drift(self.p, batch, version)
        if self.steps == self.warmup:
            self.t0, self.busy0 = t_end, farm.busy_server_s
        elif self.steps > self.warmup:
            self.tokens += sum(g.output_tokens for g in batch)
            self.gen_s.append(gen_s)
            self.train_s.append(train_s)
            self.lags += [version - g.oldest_version for g in batch]
            self.drifts.append(self.drift)
        if self.steps == self.total:
            self.t1, self.busy1 = t_end, farm.busy_server_s

    def result(self, mode: str, p: SimProfile, rollout_gpus: int, trainer_gpus: int, farm: ServerFarm, **kw):
        wall = self.t1 - self.t0 if self.warmup else self.t1
        return SimResult(
            mode=mode,
            max_staleness=p.algo.max_staleness if mode == "async" else 0,
            gpus=p.cluster.gpus,
            rollout_gpus=rollout_gpus,
            trainer_gpus=trainer_gpus,
            tokens_per_s=self.tokens / wall,
            step_s=wall / (self.total - self.warmup),
            gen_s=float(np.mean(self.gen_s)),
            train_s=float(np.mean(self.train_s)),
            staleness_mean=float(np.mean(self.lags)),
            staleness_max=int(max(self.lags)),
            rollout_busy=(self.busy1 - self.busy0) / (farm.num_servers * wall),
            drift_mean=float(np.mean(self.drifts)),
            extra={"trained_groups": float(self.total * p.algo.batch_size)},
            **kw,
        )


def run_async(p: SimProfile, rollout_fraction: float | None = None) -> SimResult:
    """The asynchronous schedule under the project's admission and freshness rules."""
    a, G, B = p.algo, p.algo.group_size, p.algo.batch_size
    rollout_gpus, trainer_gpus = p.split(rollout_fraction)
    farm = ServerFarm(rollout_gpus // p.cluster.rollout_tp, p.rollout, p.cluster.rollout_tp)
    staleness = StalenessManager(B, a.max_staleness, max(1, a.max_concurrent // G))
    law = auto_law(p)  # the trainer's drift -> the admission bound, once per version
    bounds: list[int] = []
    meter = _Meter(p)
    running: dict[int, SimGroup] = {}
    inbox: list[SimGroup] = []  # finished groups, arrival order
    requeued: list[tuple[int, int]] = []  # (data index, attempt) of expired groups, FIFO
    t, version, next_index, next_key, expired = 0.0, 0, 0, 0, 0
    trainer_until, syncing, wait_since = math.inf, False, 0.0
    batch: list[SimGroup] = []
    t_train = t_sync = 0.0

    def admit() -> None:
        nonlocal next_index, next_key
        while staleness.try_admit(version):
            if requeued:
                index, attempt = requeued.pop(0)
            else:
                index, attempt, next_index = next_index, 0, next_index + 1
            lens = group_lengths(p.lengths, G, p.run.seed, index, attempt)
            group = SimGroup(next_key, index, attempt, version, lens, remaining=G)
            running[next_key] = group
            _submit_group(farm, t, group, G)
            next_key += 1

    def try_start_step() -> None:
        nonlocal inbox, batch, trainer_until, expired, t_train
        if len(inbox) < B:
            return
        fresh, stale = split_fresh(inbox, version, a.max_staleness)  # type: ignore[arg-type]
        for g in stale:
            staleness.on_expired()
            requeued.append((g.data_index, g.attempt + 1))
        expired += len(stale)
        if len(fresh) < B:
            inbox = fresh
            return
        order = sorted(range(len(fresh)), key=lambda i: (fresh[i].oldest_version, i))
        chosen = set(order[:B])
        batch = [fresh[i] for i in order[:B]]
        inbox = [g for i, g in enumerate(fresh) if i not in chosen]
        t_train = train_time_s(batch, p.lengths.prompt_tokens, trainer_gpus, p.trainer)
        trainer_until = t + t_train

    while not meter.done:
        if not farm.paused:
            admit()
        if trainer_until == math.inf:
            try_start_step()
        t = min(farm.next_time(), trainer_until)
        if t == math.inf:
            raise RuntimeError(
                f"simulation stalled: {len(inbox)} groups buffered, {len(running)} running, version {version}"
            )
        if t == trainer_until:
            if not syncing:  # training done: pause every server and broadcast
                syncing = True
                farm.pause(t)
                t_sync = p.sync_s(version + 1)
                trainer_until = t + t_sync
            else:  # weights loaded: publish the new version and resume
                syncing, trainer_until = False, math.inf
                version += 1
                farm.resume(t)
                gen_s = t - wait_since - t_train - t_sync
                meter.step(t, farm, batch, version - 1, gen_s, t_train + t_sync)
                wait_since = t
                if law is not None:  # the trained batch's drift reaches the controller's law
                    lag = float(np.mean([version - 1 - g.oldest_version for g in batch]))
                    staleness.set_bound(law.update(meter.drift, lag))
                    bounds.append(law.bound)
            continue
        for seq in farm.pop_finished(t):
            group = running[seq // G]
            group.remaining -= 1
            if group.remaining == 0:
                del running[group.key]
                staleness.on_accepted()
                inbox.append(group)
    return meter.result("async", p, rollout_gpus, trainer_gpus, farm, expired_groups=expired, bounds=bounds)


def run_sync(p: SimProfile, rollout_fraction: float | None = None, colocated: bool = False) -> SimResult:
    """Generate B groups, wait for the last answer, train, sync: no overlap. Colocated: every GPU
    generates, then every GPU trains (as verl-style systems do)."""
    G, B = p.algo.group_size, p.algo.batch_size
    rollout_gpus, trainer_gpus = p.split(rollout_fraction)
    if colocated:
        rollout_gpus = trainer_gpus = p.cluster.gpus
    farm = ServerFarm(rollout_gpus // p.cluster.rollout_tp, p.rollout, p.cluster.rollout_tp)
    max_running = max(1, p.algo.max_concurrent // G)  # rollout.max_concurrent binds here too
    meter = _Meter(p)
    t, version = 0.0, 0
    while not meter.done:
        t_start = t
        first = version * B
        batch = [
            SimGroup(k, k, 0, version, group_lengths(p.lengths, G, p.run.seed, k, 0), remaining=G)
            for k in range(first, first + B)
        ]
        pending = list(reversed(batch))
        for _ in range(min(max_running, B)):
            _submit_group(farm, t, pending.pop(), G)
        while farm.in_flight:
            t = farm.next_time()
            for seq in farm.pop_finished(t):
                group = batch[seq // G - first]
                group.remaining -= 1
                if group.remaining == 0 and pending:  # a slot freed: the next group starts
                    _submit_group(farm, t, pending.pop(), G)
        gen_s = t - t_start
        train_s = train_time_s(batch, p.lengths.prompt_tokens, trainer_gpus, p.trainer) + p.sync_s(
            version + 1
        )
        t += train_s
        version += 1
        meter.step(t, farm, batch, version - 1, gen_s, train_s)
    return meter.result("colocated" if colocated else "sync", p, rollout_gpus, trainer_gpus, farm)


def _submit_group(farm: ServerFarm, t: float, group: SimGroup, group_size: int) -> None:
    for i, n in enumerate(group.lengths):
        farm.submit(t, group.key * group_size + i, n)
