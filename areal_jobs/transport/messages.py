"""Every message that crosses the controller <-> trainer boundary, one dataclass per kind.

Trajectories travel as `TrajectoryGroup` (one per prompt: all G samples, so group-normalised
advantages never wait across messages). Control messages are small and JSON-encoded.
Array legend: [n] = one entry per output token of a sample; [p] = one per prompt token.
A sample is an episode (agent/episode.py): its output tokens are model turns and environment
tokens back to back, told apart by `loss_mask`.
Adding a feature means adding a typed field or a new kind here, never a key in a metadata dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from areal_jobs.api import WeightSender

SCHEMA_VERSION = 4  # 3: episodes (loss_mask, num_turns, num_tool_calls); 4: expert routes

# ------------------------------------------------------------------------------ trajectories


@dataclass(frozen=True, slots=True, eq=False)
class SampleTrajectory:
    """One episode: a sampled answer, or model turns with environment tokens between them.
    Every model token keeps its behaviour log-prob and policy version."""

    sample_id: str  # "<group_id>/<i>"
    output_ids: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n], log pi_behaviour(token) when it was sampled; 0.0 where loss_mask is 0
    versions: np.ndarray  # int32 [n], policy version each token was sampled (environment: appended) under
    reward: float
    reward_status: str  # api.RewardStatus value or "error" (agent.EpisodeError); not "ok" is counted
    finish_reason: str  # of the last model turn: "stop" | "length"
    num_interruptions: int  # weight updates this sample lived through
    loss_mask: np.ndarray | None = None  # uint8 [n]: 1 on model tokens, 0 on environment tokens; None = all 1
    num_turns: int = 1  # model turns
    num_tool_calls: int = 0
    # trainer.routing_replay=rollout on a mixture of experts: uint8 (uint16 with 255+ experts)
    # [p + n, layers, top_k], the experts the engine routed each prompt and output position to;
    # rows of all ones: not reported (transport/routes.py). None: dense model or replay off
    routes: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.output_ids.shape[0])

    def model_versions(self) -> np.ndarray:
        """int32 [<= n]: the versions of the model's tokens (what decides freshness)."""
        return self.versions if self.loss_mask is None else self.versions[self.loss_mask.astype(bool)]


@dataclass(frozen=True, slots=True, eq=False)
class TrajectoryGroup:
    """All G samples of one prompt, scored, ready for training."""

    group_id: str  # unique per prompt admission; an opaque key (identity is data_index + attempt)
    data_index: int  # position of the prompt in the seeded prompt stream
    prompt_ids: np.ndarray  # int32 [p]
    samples: tuple[SampleTrajectory, ...]
    gen_time_s: float = 0.0  # admission -> last sample finished
    reward_time_s: float = 0.0
    attempt: int = 0  # 0 the first time; +1 each time the group expired and was generated again
    source: str = ""  # the prompt's source (a mixture's source, or the row's data_source): per-source metrics

    @property
    def oldest_version(self) -> int:
        """The staleness bound is checked against the oldest model token of any sample
        (environment tokens are never older than the model tokens before them)."""
        found = [s.model_versions() for s in self.samples]
        return min((int(v.min()) for v in found if v.size), default=0)

    @property
    def newest_version(self) -> int:
        found = [s.model_versions() for s in self.samples]
        return max((int(v.max()) for v in found if v.size), default=0)


# ------------------------------------------------------------------------------ control


@dataclass(frozen=True, slots=True)
class TrainerHello:
    """Trainer rank 0 -> controller on start and after every restart."""

    version: int  # the policy version the trainer holds (what the servers must also hold)
    step: int
    resumed: bool = False  # restored from a checkpoint: its weights must reach the servers first


@dataclass(frozen=True, slots=True)
class ControllerHello:
    """Controller -> trainer: answer to TrainerHello."""

    version: int  # the version the servers hold now
    num_servers: int


@dataclass(frozen=True, slots=True)
class PauseRequest:
    """Trainer finished a step: pause generation and prepare to receive `version`'s weights."""

    version: int  # the new version being published
    senders: tuple[WeightSender, ...]  # who broadcasts which buckets, in order
    backend: str  # "gloo" | "nccl"
    trained_group_ids: tuple[str, ...] = ()  # the step's batch; the controller's ledger
    disk_path: str = ""  # weight_sync.method=disk: load this HF directory instead of broadcasting
    adapter_path: str = ""  # model.lora.ship=adapter: load this PEFT directory (nothing broadcast)
    # the trainer dropped its broadcast group (its half of an earlier broadcast timed out, though the
    # servers may have received it all): the groups must be formed again before this broadcast
    regroup: bool = False


@dataclass(frozen=True, slots=True)
class GroupsExpired:
    """Trainer -> controller, at once: these groups are too stale to train; generate them again.

    Sent immediately (not with the next PauseRequest): their staleness slots must be freed before
    the trainer can fill its batch, or admission and training would wait on each other.
    """

    group_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Paused:
    """Controller -> trainer: servers paused; broadcast group ready to form (world_size ranks)."""

    version: int
    world_size: int  # per sender group: 1 (the sender) + every server rank
    init_group: bool  # True: the groups must be (re)created before the broadcast
    group_generation: int  # groups are named "<sender.group_name>-<generation>"; new on every (re)creation
    # every stage timeout of this attempt is weight_sync.step_timeout_s times this: 1, then 2, 4, ...
    # for each time the same version was sent again after a stage timed out with every server alive
    timeout_scale: float = 1.0
    # the version every server of this update holds from a completed update; -1 when they differ
    # or one is new, restarted or was in a broken update (weight_sync.sync=delta: only onto it)
    servers_version: int = -1


@dataclass(frozen=True, slots=True)
class VersionPublished:
    """Controller -> trainer: every server holds `version` and generation resumed."""

    version: int
    update_s: float  # pause -> resume wall time seen by the controller
    pause_s: float = 0.0  # stopping generation (abort / pause calls)
    receive_s: float = 0.0  # group formation + every bucket's calls + end of update, the slowest server
    resume_s: float = 0.0
    # per server, every bucket call's round trip (receive + load), the slowest server
    bucket_calls_s: float = 0.0
    staleness_bound: int = -1  # the admission bound eta in force (algo.max_staleness=auto moves it)


@dataclass(frozen=True, slots=True)
class DriftReport:
    """Trainer -> controller after each step, under algo.max_staleness=auto (before the step's
    PauseRequest): the drift the step measured, for the controller's staleness bound law
    (areal_jobs/staleness_bound.py). Only steps that measured it send one."""

    version: int  # the version this step produces (the PauseRequest that follows publishes it)
    drift: float  # algo.staleness_drift: offpolicy/preclip_fraction, or 1 - offpolicy/ess
    staleness_mean: float  # the batch's mean staleness in versions (what the drift grew from)


@dataclass(frozen=True, slots=True)
class BroadcastDone:
    """Trainer -> controller, after the encoded buckets of `version` (weight_sync.sync=delta): did
    every collective of its broadcast complete? SGLang's custom weight loader cannot fail its call
    when the group breaks under it (an exception ends SGLang's scheduler), so the controller ends
    an encoded update only on the trainer's word; `ok` False is a failed stage (sent again)."""

    version: int
    ok: bool
    detail: str = ""


@dataclass(frozen=True, slots=True)
class UpdateFailed:
    """Controller -> trainer: a weight-update stage failed; the job must exit non-zero."""

    version: int
    stage: str  # e.g. "weight broadcast bucket 3/7 to server 2"
    error: str


# UpdateRetry is sent at most this often for one version: servers dying inside the same update
# again and again end the run (the controller then sends UpdateFailed; the trainer gives up too)
MAX_UPDATE_RETRIES = 3
# ... and at most this often, besides, when a stage timed out while every server still answers (a
# slow machine, a stalled trainer): each such repeat doubles the stage timeouts, within
# control.update_deadline_s
MAX_SLOW_UPDATE_RETRIES = 4


@dataclass(frozen=True, slots=True)
class UpdateRetry:
    """Controller -> trainer: servers `lost` died during the update to `version`; they left the
    pool and the others stay paused. Drop this broadcast and ask again (PauseRequest, same version):
    the groups are re-formed without them, and the survivors receive every bucket again. `lost`
    empty: a stage timed out while every server still answers (a slow machine); the same, with
    longer stage timeouts (the next Paused says how much longer)."""

    version: int
    lost_servers: tuple[int, ...]
    stage: str  # the stage that failed, e.g. "weight broadcast bucket 2/5 of sender s0 to server 1"
    error: str


@dataclass(frozen=True, slots=True)
class CheckpointRequest:
    """Trainer -> controller after step `step`: snapshot rollout state into `path` (keep generating)."""

    step: int
    version: int
    path: str


@dataclass(frozen=True, slots=True)
class CheckpointSaved:
    """Controller -> trainer: its half of checkpoint `step` is on disk."""

    step: int
    num_groups: int  # trajectory groups pushed but not yet trained, saved whole
    num_partial_samples: int  # samples in progress, saved with their tokens, log-probs and versions


@dataclass(frozen=True, slots=True)
class WeightsNeeded:
    """Controller -> trainer: a (re)joined server needs the current weights; publish them again."""

    reason: str


@dataclass(frozen=True, slots=True)
class RolloutStats:
    """Controller -> trainer: flat rollout metrics for the run's one metrics sink."""

    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EvalResult:
    """Controller -> trainer: held-out accuracy of the policy at `version`."""

    version: int
    accuracy: float  # pass@1: mean over prompts of the share of correct samples
    mean_reward: float
    num_prompts: int
    kind: str  # "start" | "periodic" | "final", with "_greedy" for temperature 0
    by_bucket: dict[str, float] = field(default_factory=dict)  # accuracy per prompt bucket (chain length)
    bucket_sizes: dict[str, int] = field(default_factory=dict)
    by_source: dict[str, float] = field(default_factory=dict)  # accuracy per source (eval/<name>/accuracy)
    source_sizes: dict[str, int] = field(default_factory=dict)
    pass_at_k: float = 0.0  # unbiased pass@k from samples_per_problem answers per prompt
    k: int = 1
    samples_per_problem: int = 1
    mean_length_tokens: float = 0.0
    truncation_rate: float = 0.0  # share of answers stopped by rollout.max_new_tokens


@dataclass(frozen=True, slots=True)
class Stop:
    """Trainer -> controller: training is over; run the final evaluation, then exit."""

    reason: str
    final_eval: bool = True


@dataclass(frozen=True, slots=True)
class Stopped:
    """Controller -> trainer: controller drained and is exiting, with its final counters."""

    num_groups_pushed: int
    metrics: dict[str, float] = field(default_factory=dict)


CONTROL_MESSAGES = (
    TrainerHello,
    ControllerHello,
    PauseRequest,
    GroupsExpired,
    Paused,
    VersionPublished,
    BroadcastDone,
    UpdateFailed,
    UpdateRetry,
    RolloutStats,
    EvalResult,
    Stop,
    Stopped,
    CheckpointRequest,
    CheckpointSaved,
    WeightsNeeded,
    DriftReport,
)
ControlMessage = (
    TrainerHello
    | ControllerHello
    | PauseRequest
    | GroupsExpired
    | Paused
    | VersionPublished
    | BroadcastDone
    | UpdateFailed
    | UpdateRetry
    | RolloutStats
    | EvalResult
    | Stop
    | Stopped
    | CheckpointRequest
    | CheckpointSaved
    | WeightsNeeded
    | DriftReport
)
