"""Reward workers: verifiers and the code sandbox."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class NetworkIsolation(enum.Enum):
    auto = "auto"  # a network namespace when permitted, else rlimits + scrubbed env only
    netns = "netns"  # require a network namespace (fail if it cannot be created)
    none = "none"  # no network isolation (trusted code only)


@dataclass
class RewardConfig:
    """Reward workers: verifiers and the code sandbox."""

    num_workers: int = 2  # process-pool size
    timeout_s: float = 30.0  # one reward call, sandbox included
    code_cpu_s: int = 10  # RLIMIT_CPU per program
    code_memory_mb: int = 1024  # RLIMIT_AS per program
    code_max_procs: int = 64  # RLIMIT_NPROC per program
    code_max_file_mb: int = 16  # RLIMIT_FSIZE per program
    code_max_open_files: int = 64  # RLIMIT_NOFILE per program
    code_wall_timeout_s: float = 10.0
    code_max_output_bytes: int = 1 << 20  # untrusted stdout/stderr is read up to this size
    network_isolation: NetworkIsolation = NetworkIsolation.auto  # netns also brings PID + mount namespaces
    # Worker i runs programs as uid code_sandbox_uid + i (when we are root). RLIMIT_NPROC counts
    # every process of a uid, so one uid per worker keeps a fork bomb in one sandbox from using up
    # the process budget of the sandbox beside it (or of daemons running as nobody). The default
    # range belongs to no account; a program needs no passwd entry.
    code_sandbox_uid: int = 1_900_000_000
    code_sandbox_gid: int = 65534  # gid programs run as when we are root (nogroup)
    code_tmpfs_mb: int = 64  # namespace mode: size cap of the program's private writable work dir
    code_python: str = ""  # interpreter for programs (run -I -S: stdlib only); empty = the worker's

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError("reward.num_workers must be >= 1")
        if self.code_sandbox_uid == 0 or self.code_sandbox_gid == 0:
            raise ValueError(
                "reward.code_sandbox_uid/gid=0 would run untrusted code as root: "
                "use an unused uid range, e.g. reward.code_sandbox_uid=1900000000"
            )
        if not 0 < self.code_sandbox_uid <= 2**32 - 2 - (self.num_workers - 1):
            raise ValueError(
                f"reward.code_sandbox_uid={self.code_sandbox_uid} with reward.num_workers={self.num_workers} "
                "leaves the uid range (0, 2**32 - 1): workers use code_sandbox_uid + worker index"
            )
        if self.timeout_s <= self.code_wall_timeout_s:
            raise ValueError(
                "reward.timeout_s must exceed reward.code_wall_timeout_s (a call includes its sandbox run): "
                f"e.g. reward.timeout_s={self.code_wall_timeout_s * 3:g}"
            )
