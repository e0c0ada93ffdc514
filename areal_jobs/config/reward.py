"""Reward workers: verifiers and the code sandbox."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from areal_jobs.config.reward_model import RewardModelConfig


class NetworkIsolation(enum.Enum):
    """How the code sandbox isolates programs (docs/sandbox.md). netns and userns are the strong
    modes: new network, PID and mount namespaces, a private tmpfs root; none is the weak mode."""

    auto = "auto"  # the strongest mode that works here; refuses to start when neither strong one does
    netns = "netns"  # root: namespaces + a per-service sandbox uid (fails if unavailable)
    userns = "userns"  # any user: the same namespaces inside a user namespace (fails if unavailable)
    none = "none"  # weak, explicit opt-in only: rlimits, scrubbed env, process-group kill


class RewardSource(enum.Enum):
    """What the training reward is made of (reward/combined.py)."""

    verifier = "verifier"  # the task's checker alone (math verifier, code sandbox): the default
    # the reward model alone (tasks without a checker); where the task has one, it still runs,
    # for the reward/verifier_* metrics only: how far the policy exploits the model
    model = "model"
    # verifier_weight * verifier reward + model_weight * model score
    combined = "combined"


class FunctionIsolation(enum.Enum):
    """Where a user's reward function (reward.function) runs (reward/user_fn.py)."""

    process = "process"  # imported and called in the reward worker processes: code you trust
    # each call in the code sandbox (reward.network_isolation's mode, the code_* limits), the file
    # never imported by us: code a cluster admin does not trust; the standard library only
    sandbox = "sandbox"


@dataclass
class RewardConfig:
    """Reward workers: verifiers and the code sandbox; the reward model (reward.model.*)."""

    num_workers: int = 2  # process-pool size
    timeout_s: float = 30.0  # one reward call, sandbox included
    code_cpu_s: int = 10  # RLIMIT_CPU per program
    code_memory_mb: int = 1024  # RLIMIT_AS per program
    code_max_procs: int = 64  # RLIMIT_NPROC per program
    code_max_file_mb: int = 16  # RLIMIT_FSIZE per program
    code_max_open_files: int = 64  # RLIMIT_NOFILE per program
    code_wall_timeout_s: float = 10.0  # wall-clock limit per sandboxed program
    code_max_output_bytes: int = 1 << 20  # untrusted stdout/stderr is read up to this size
    network_isolation: NetworkIsolation = NetworkIsolation.auto
    # When root, each worker claims one uid of [code_sandbox_uid, + code_sandbox_uid_count) with a
    # lock file in code_sandbox_uid_lock_dir, held for its life: no two workers on a host (of this
    # service or of another job's) share a uid. RLIMIT_NPROC counts every process of a uid, so a fork
    # bomb in one sandbox cannot use up the process budget of another, nor signal its programs.
    # The default range belongs to no account; a program needs no passwd entry.
    code_sandbox_uid: int = 1_900_000_000
    code_sandbox_uid_count: int = 4096
    code_sandbox_uid_lock_dir: str = "/run/areal-sandbox-uids"
    code_sandbox_gid: int = 65534  # gid programs run as when we are root (nogroup)
    code_tmpfs_mb: int = 64  # namespace mode: size cap of the program's private writable work dir
    code_python: str = ""  # interpreter for programs (run -I -S: stdlib only); empty = the worker's
    source: RewardSource = RewardSource.verifier
    verifier_weight: float = 1.0  # reward.source=combined
    model_weight: float = 1.0  # reward.source=combined
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    # your own reward: path/to/rewards.py:compute_score (or package.module:fn), with the signature
    # (response, reference) or verl's (data_source, solution_str, ground_truth, extra_info);
    # "" = the dataset's built-in verifier (docs/your-task.md)
    function: str = ""
    function_isolation: FunctionIsolation = FunctionIsolation.process  # sandbox: untrusted code

    def __post_init__(self) -> None:
        if self.function.strip() != self.function or (self.function and self.function.endswith(":")):
            raise ValueError(
                f"reward.function={self.function!r}: expected path/to/rewards.py:compute_score "
                "or package.module:function"
            )
        if self.num_workers < 1:
            raise ValueError("reward.num_workers must be >= 1")
        if self.source is not RewardSource.verifier and not self.model.path:
            raise ValueError(
                f"reward.source={self.source.value} needs a reward model: set reward.model.path "
                "(e.g. reward.model.path=areal_jobs/tasks/models/builtin_reward_model)"
            )
        if self.source is RewardSource.combined and (
            self.verifier_weight < 0 or self.model_weight < 0 or self.verifier_weight + self.model_weight == 0
        ):
            raise ValueError(
                "reward.source=combined needs reward.verifier_weight and reward.model_weight >= 0, "
                "not both 0 (reward.source=verifier or =model for one source alone)"
            )
        if self.code_sandbox_uid == 0 or self.code_sandbox_gid == 0:
            raise ValueError(
                "reward.code_sandbox_uid/gid=0 would run untrusted code as root: "
                "use an unused uid range, e.g. reward.code_sandbox_uid=1900000000"
            )
        if self.code_sandbox_uid_count < self.num_workers:
            raise ValueError(
                f"reward.code_sandbox_uid_count={self.code_sandbox_uid_count} < reward.num_workers: "
                "every worker needs its own sandbox uid"
            )
        if not 0 < self.code_sandbox_uid <= 2**32 - 2 - (self.code_sandbox_uid_count - 1):
            raise ValueError(
                f"reward.code_sandbox_uid={self.code_sandbox_uid} with reward.code_sandbox_uid_count="
                f"{self.code_sandbox_uid_count} leaves the uid range (0, 2**32 - 1)"
            )
        if self.timeout_s <= self.code_wall_timeout_s:
            raise ValueError(
                "reward.timeout_s must exceed reward.code_wall_timeout_s (a call includes its sandbox run): "
                f"e.g. reward.timeout_s={self.code_wall_timeout_s * 3:g}"
            )
