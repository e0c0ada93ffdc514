"""Simulator inputs: one profile = cluster shape, rollout and trainer speed, weight sync, the
generation-length distribution and the algorithm's batch/staleness settings.

Profiles are YAML files under conf/sim/ (`load_profile("paper_1p5b")`), validated by these
dataclasses through OmegaConf, and overridable with dotted keys (`algo.max_staleness=8`).
Every check names the key that fixes it. Units are in the names: *_tokens, *_s, *_per_s.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launch.planning.sim.weight_update import WeightUpdateModel

PROFILE_DIR = Path(__file__).resolve().parents[3] / "conf" / "sim"


@dataclass
class ClusterShape:
    """How many GPUs, and how they are split between rollout and training."""

    nodes: int = 64
    gpus_per_node: int = 8
    rollout_fraction: float = (
        0.75  # share of nodes running rollout servers (rounded down, as launch.planning.layout.plan)
    )
    rollout_tp: int = 1  # GPUs per rollout server

    def check(self) -> None:
        if self.nodes < 2 or self.gpus_per_node < 1:
            raise ValueError("cluster.nodes must be >= 2 and cluster.gpus_per_node >= 1")
        if not 0.0 < self.rollout_fraction < 1.0:
            raise ValueError("cluster.rollout_fraction must be in (0, 1)")
        if self.gpus_per_node % self.rollout_tp:
            raise ValueError(f"cluster.rollout_tp={self.rollout_tp} must divide cluster.gpus_per_node")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class RolloutSpeed:
    """Decode throughput of one GPU as a function of its batch (concurrent sequences).

    Linear between the table's points, flat past the last one; a server of `rollout_tp` GPUs is
    modelled as `rollout_tp` times one GPU. `max_batch_per_gpu` is the KV-cache capacity: more
    requests than that wait in the server's queue, as in SGLang.
    """

    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32, 128])
    tokens_per_s: list[float] = field(default_factory=lambda: [300.0, 2000.0, 4500.0, 6000.0])
    max_batch_per_gpu: int = 128

    def check(self) -> None:
        if len(self.batch_sizes) != len(self.tokens_per_s) or not self.batch_sizes:
            raise ValueError(
                "rollout.batch_sizes and rollout.tokens_per_s must be non-empty and the same length"
            )
        if self.batch_sizes[0] < 1 or any(
            b >= c for b, c in zip(self.batch_sizes, self.batch_sizes[1:], strict=False)
        ):
            raise ValueError("rollout.batch_sizes must be increasing and start at >= 1")
        if any(v <= 0 for v in self.tokens_per_s):
            raise ValueError("rollout.tokens_per_s must be > 0")
        if self.max_batch_per_gpu < 1:
            raise ValueError("rollout.max_batch_per_gpu must be >= 1")

    def gpu_tokens_per_s(self, batch: float) -> float:
        """Interpolated per-GPU decode throughput at `batch` concurrent sequences (0 at batch 0)."""
        if batch <= 0:
            return 0.0
        xs, ys = self.batch_sizes, self.tokens_per_s
        if batch <= xs[0]:
            return ys[0] * batch / xs[0]  # below the first point: proportional to the batch
        if batch >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, batch)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (batch - x0) / (x1 - x0)


@dataclass
class TrainerSpeed:
    tokens_per_s_per_gpu: float = 10000.0  # prompt + output tokens a trainer GPU processes per second
    weight_sync_s: float = 5.0  # pause + broadcast + reload, per step; servers and trainer both stall
    step_overhead_s: float = 0.0  # fixed cost per step (optimizer, logging), independent of tokens

    def check(self) -> None:
        if self.tokens_per_s_per_gpu <= 0 or self.weight_sync_s < 0 or self.step_overhead_s < 0:
            raise ValueError("trainer.tokens_per_s_per_gpu must be > 0; weight_sync_s, step_overhead_s >= 0")


@dataclass
class LengthModel:
    """Long-tailed answer lengths: lognormal per prompt (hard prompts have long answers for every
    sample), lognormal per sample around it, clipped to [min_tokens, max_tokens] (the cap is
    max_new_tokens: answers that reach it are truncated)."""

    median_tokens: float = 4000.0
    prompt_sigma: float = 0.6
    sample_sigma: float = 0.5
    min_tokens: int = 16
    max_tokens: int = 32768
    prompt_tokens: int = 256

    def check(self) -> None:
        if not 0 < self.min_tokens <= self.median_tokens <= self.max_tokens:
            raise ValueError("lengths: need 0 < min_tokens <= median_tokens <= max_tokens")
        if self.prompt_sigma < 0 or self.sample_sigma < 0 or self.prompt_tokens < 1:
            raise ValueError(
                "lengths.prompt_sigma, lengths.sample_sigma must be >= 0; lengths.prompt_tokens >= 1"
            )


@dataclass
class AlgoShape:
    """The algo.* and rollout.* settings of the job that shape the schedule."""

    batch_size: int = 512  # B prompt groups per step
    group_size: int = 16  # G answers per prompt
    max_staleness: int = 4  # eta; the ceiling under staleness_auto
    max_concurrent: int = 16384  # rollout.max_concurrent (samples in flight)
    # the job's algo.max_staleness=auto (areal_jobs/staleness_bound.py): the bound follows the drift that
    # `drift` (SimProfile) models, from max_staleness (the ceiling) down to staleness_floor
    staleness_auto: bool = False
    staleness_floor: int = 0
    staleness_drift_target: float = 0.03
    staleness_raise_below: float = 0.5
    staleness_hold_steps: int = 10
    staleness_window_steps: int = 5

    def check(self) -> None:
        if self.batch_size < 1 or self.group_size < 1 or self.max_staleness < 0:
            raise ValueError("algo.batch_size and algo.group_size must be >= 1, algo.max_staleness >= 0")
        if self.staleness_auto and not 0 <= self.staleness_floor < self.max_staleness:
            raise ValueError(
                "algo.staleness_auto=true: algo.max_staleness is the ceiling; need 0 <= "
                "algo.staleness_floor < algo.max_staleness (e.g. algo.max_staleness=8)"
            )
        if self.max_concurrent < self.group_size:
            raise ValueError("algo.max_concurrent must hold at least one group (>= algo.group_size)")


@dataclass
class DriftModel:
    """The drift measure a trained batch shows (offpolicy/preclip_fraction), from its mean lag:
    min(1, per_version * lag) * (1 + noise * N(0, 1)), clipped to [0, 1], the normal draw seeded by
    (run.seed, version). Linear in the lag, as measured on countdown (docs/objective.md: naive
    PPO at lr 3e-4 3.7% at exactly 2 versions, 9.8% at 8, i.e. ~0.012 a version)."""

    per_version: float = 0.012
    noise: float = 0.0  # relative spread of one step's measure (one batch's tokens)
    # from version late_from_version on, per_version becomes late_per_version (a policy that moves
    # less per version later in the run, e.g. a decayed lr); -1 = no change
    late_per_version: float = -1.0
    late_from_version: int = 0

    def check(self) -> None:
        if self.per_version < 0 or self.noise < 0 or self.late_from_version < 0:
            raise ValueError("drift.per_version, drift.noise and drift.late_from_version must be >= 0")

    def at(self, lag: float, seed: int, version: int) -> float:
        import numpy as np

        late = self.late_per_version >= 0 and version >= self.late_from_version
        slope = self.late_per_version if late else self.per_version
        eps = np.random.default_rng((seed, version, 7)).standard_normal() if self.noise else 0.0
        return float(min(1.0, max(0.0, min(1.0, slope * lag) * (1.0 + self.noise * eps))))


@dataclass
class SimControl:
    warmup_steps: int = 6  # not measured: the pipeline fills (eta + 1 batches in flight)
    measure_steps: int = 8
    seed: int = 0

    def check(self) -> None:
        if self.warmup_steps < 0 or self.measure_steps < 1:
            raise ValueError("run.warmup_steps must be >= 0 and run.measure_steps >= 1")


@dataclass
class SimProfile:
    name: str = "custom"
    description: str = ""
    cluster: ClusterShape = field(default_factory=ClusterShape)
    rollout: RolloutSpeed = field(default_factory=RolloutSpeed)
    trainer: TrainerSpeed = field(default_factory=TrainerSpeed)
    lengths: LengthModel = field(default_factory=LengthModel)
    algo: AlgoShape = field(default_factory=AlgoShape)
    run: SimControl = field(default_factory=SimControl)
    # the update's phases from the model size and links (weights.params_b > 0); else the constant
    # trainer.weight_sync_s
    weights: WeightUpdateModel = field(default_factory=WeightUpdateModel)
    drift: DriftModel = field(default_factory=DriftModel)  # what algo.staleness_auto reads

    def __post_init__(self) -> None:
        for part in (
            self.cluster,
            self.rollout,
            self.trainer,
            self.lengths,
            self.algo,
            self.run,
            self.weights,
            self.drift,
        ):
            part.check()

    def sync_s(self, version: int) -> float:
        """Seconds the servers stay paused to take `version` (a full copy or a delta)."""
        return self.weights.update_s(version) if self.weights.enabled else self.trainer.weight_sync_s

    def split(self, rollout_fraction: float | None = None) -> tuple[int, int]:
        """(rollout GPUs, trainer GPUs), nodes rounded down as launch.planning.layout.plan.split_nodes does."""
        c = self.cluster
        frac = c.rollout_fraction if rollout_fraction is None else rollout_fraction
        rollout_nodes = math.floor(c.nodes * frac + 1e-9)
        if not 1 <= rollout_nodes < c.nodes:
            raise ValueError(
                f"cluster.rollout_fraction={frac} of cluster.nodes={c.nodes} leaves a role without nodes"
            )
        return rollout_nodes * c.gpus_per_node, (c.nodes - rollout_nodes) * c.gpus_per_node


def load_profile(name_or_path: str, overrides: list[str] | tuple[str, ...] = ()) -> SimProfile:
    """A profile from conf/sim/<name>.yaml (or a YAML path), with dotted overrides applied."""
    from omegaconf import OmegaConf

    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))
        raise ValueError(f"no simulator profile {name_or_path!r}: use one of {known} or a YAML path")
    merged = OmegaConf.merge(OmegaConf.structured(SimProfile), OmegaConf.load(path))
    if overrides:
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
    obj: Any = OmegaConf.to_object(merged)
    assert isinstance(obj, SimProfile)
    return obj
