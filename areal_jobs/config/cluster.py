"""Where the job runs: local processes or one heterogeneous SLURM job."""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field


class ClusterKind(enum.Enum):
    local = "local"  # every process on this machine, started by launch.local
    slurm = "slurm"  # one heterogeneous SLURM job rendered by launch.slurm.render


class Placement(enum.Enum):
    """How roles share the GPUs (launch/planning/layout/placement.py)."""

    auto = "auto"  # whole nodes where the rollout fraction splits the nodes exactly, else GPU-level
    nodes = "nodes"  # heterogeneous job: rollout nodes + trainer nodes (needs cluster.nodes >= 2)
    gpus = "gpus"  # one job, GPU-level split: the last node hosts rollout servers and the trainer
    colocated = "colocated"  # one node: servers and trainer time-share every GPU (synchronous, eta 0)


# SLURM --time: "M", "M:S", "H:M:S", "D-H", "D-H:M", "D-H:M:S"
_SLURM_TIME = re.compile(r"^(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2})$")


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class ClusterConfig:
    """Where the job runs. Cluster mode renders one heterogeneous SLURM job (launch/planning/layout/plan.py
    decides the layout, launch/slurm/render.py writes the script); local mode runs launch.run.local."""

    kind: ClusterKind = ClusterKind.local
    nodes: int = 1  # total nodes of the heterogeneous job (rollout + trainer)
    gpus_per_node: int = 8  # GPUs requested on every node (--gres=gpu:N)
    # memory of one GPU (H800 / H100: 80): the planner refuses a trainer that does not fit it and
    # sizes the rollout servers' KV cache from it (launch/planning/fit/memory_plan.py, docs/memory.md)
    gpu_memory_gib: float = 80.0
    # share of nodes that run rollout servers (rounded down), or "auto": launch.plan_allocation
    # simulates the job under `allocation_profile` and picks the split with the highest throughput.
    # A string so that "auto" is accepted; numbers are normalised and checked in __post_init__.
    rollout_fraction: str = "0.75"
    placement: Placement = Placement.auto  # whole nodes, a GPU-level split, or colocated (see Placement)
    # reward-model servers (reward.source=model|combined) on nodes of their own: the third component
    # of the heterogeneous job (whole nodes). cluster.reward_nodes > 0 wins; else
    # floor(nodes * reward_fraction), at least one node when the fraction is > 0. The rollout
    # fraction then splits the nodes left (launch/planning/layout/plan.py)
    reward_fraction: float = 0.0
    reward_nodes: int = 0
    allocation_profile: str = "paper_1p5b"  # conf/sim/<name>.yaml (or a path) used by rollout_fraction=auto
    servers_per_node: int = 0  # rollout servers per node; 0 = gpus_per_node / rollout.tp_size
    partition: str = ""  # --partition; empty = the cluster's default partition
    account: str = ""  # --account; empty = the user's default account
    qos: str = ""  # --qos; empty = the account's default QOS
    time_limit: str = "24:00:00"  # --time, SLURM format (e.g. 2-00:00:00)
    cpus_per_task: int = 8  # --cpus-per-task for every server and trainer task
    mem_per_node: str = ""  # e.g. "1800G"; empty = SLURM default
    sbatch_args: list[str] = field(default_factory=list)  # extra options for both components
    container_image: str = ""  # pyxis --container-image; empty = bare metal
    container_mounts: str = ""  # pyxis --container-mounts (src:dst[,src:dst])
    workdir: str = ""  # --chdir of the job (shared FS); empty = the directory `make submit` runs in
    python: str = ""  # interpreter on the nodes; empty = the one running launch.submit
    master_port: int = 29500  # trainer torch.distributed MASTER_PORT on the first trainer node
    loopback: bool = False  # every fake node is this host (local_slurm tests): use 127.0.0.1
    requeue_signal_s: int = 300  # --signal=B:USR1@<s>: checkpoint and requeue before the limit
    # how often the job script looks for lost nodes (squeue; a role that exits wakes it at once)
    node_check_s: int = 10
    # how often a satellite job (launch.scale +N) checks that its main job still runs
    satellite_watch_s: int = 5
    nccl_env: dict[str, str] = field(default_factory=dict)  # NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ...
    # online re-planning (launch/run/replanner.py): every N trained steps the measured speeds and answer
    # lengths go into `allocation_profile` and plan/* metrics are logged; 0 = off
    replan_every_steps: int = 20
    autoscale: bool = False  # act on the re-plan: grow or shrink the rollout pool (local: servers)
    # most rollout nodes (local: servers) autoscale may run; needed with autoscale
    autoscale_max_nodes: int = 0
    # act only for >= 10% more trained tok/s (grow) or trained tok/s per node (shrink)
    autoscale_min_gain: float = 0.1

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError("cluster.nodes must be >= 1")
        if self.gpus_per_node < 1:
            raise ValueError("cluster.gpus_per_node must be >= 1")
        if self.gpu_memory_gib <= 0:
            raise ValueError("cluster.gpu_memory_gib must be > 0 (memory of one GPU, e.g. 80 for H800/H100)")
        self.rollout_fraction = _fraction_text(self.rollout_fraction)
        if self.servers_per_node < 0:
            raise ValueError("cluster.servers_per_node must be >= 0 (0 = gpus_per_node / rollout.tp_size)")
        if self.cpus_per_task < 1:
            raise ValueError("cluster.cpus_per_task must be >= 1")
        if not _SLURM_TIME.match(self.time_limit):
            raise ValueError(
                f"cluster.time_limit={self.time_limit!r} is not a SLURM time: use e.g. "
                "cluster.time_limit=24:00:00 or cluster.time_limit=2-00:00:00"
            )
        if not 0 <= self.requeue_signal_s <= 65535:
            raise ValueError("cluster.requeue_signal_s must be in [0, 65535] (0 = no USR1 before the limit)")
        for name in ("node_check_s", "satellite_watch_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"cluster.{name} must be >= 1 (seconds between two checks)")
        if not 0 < self.master_port < 65536:
            raise ValueError("cluster.master_port must be a TCP port in [1, 65535]")
        self._check_autoscale()
        if not 0.0 <= self.reward_fraction < 1.0 or self.reward_nodes < 0:
            raise ValueError(
                "cluster.reward_fraction must be in [0, 1) and cluster.reward_nodes >= 0, "
                "e.g. cluster.reward_nodes=2 (0 and 0: no reward-model nodes)"
            )
        if self.reward_share_nodes() and self.reward_share_nodes() > self.nodes - 2:
            raise ValueError(
                f"cluster.reward_nodes / cluster.reward_fraction leave too few of cluster.nodes={self.nodes} "
                "for the rollout servers and the trainer (one node each at least): lower them"
            )
        bad = [key for key in self.nccl_env if not _ENV_NAME.match(key)]
        if bad:
            raise ValueError(f"cluster.nccl_env has keys that are not environment variable names: {bad}")

    def _check_autoscale(self) -> None:
        if self.replan_every_steps < 0:
            raise ValueError("cluster.replan_every_steps must be >= 0 (0 = no online re-planning)")
        if self.autoscale_min_gain < 0:
            raise ValueError("cluster.autoscale_min_gain must be >= 0, e.g. cluster.autoscale_min_gain=0.1")
        if self.autoscale_max_nodes < 0:
            raise ValueError("cluster.autoscale_max_nodes must be >= 0")
        if self.autoscale and self.replan_every_steps == 0:
            raise ValueError("cluster.autoscale=true acts on the re-plan: set cluster.replan_every_steps=20")
        if self.autoscale and self.autoscale_max_nodes < 1:
            raise ValueError(
                "cluster.autoscale=true needs a ceiling: set cluster.autoscale_max_nodes=N "
                "(rollout nodes; rollout servers on cluster=local)"
            )

    def reward_share_nodes(self) -> int:
        """Nodes of the reward-model servers: cluster.reward_nodes, else the fraction's (0 = none)."""
        if self.reward_nodes:
            return self.reward_nodes
        if not self.reward_fraction:
            return 0
        return max(1, math.floor(self.nodes * self.reward_fraction + 1e-9))

    @property
    def rollout_fraction_auto(self) -> bool:
        return self.rollout_fraction == "auto"

    @property
    def rollout_share(self) -> float:
        """The numeric rollout fraction; `auto` must have been resolved (launch.plan_allocation does it)."""
        if self.rollout_fraction_auto:
            raise ValueError(
                "cluster.rollout_fraction=auto is resolved by launch.planning.layout.allocation.resolve_auto_fraction, not read directly"
            )
        return float(self.rollout_fraction)


def _fraction_text(value: object) -> str:
    """Normalise to the text "auto" or a number in (0, 1) ("0.75"); anything else names the override."""
    if value == "auto":
        return "auto"
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = float("nan")
    if not 0.0 < number < 1.0:
        raise ValueError(
            f"cluster.rollout_fraction={value!r} must be in (0, 1) or auto, e.g. cluster.rollout_fraction=0.75"
        )
    return repr(number)


@dataclass
class LaunchConfig:
    """How launch.submit handles the rendered job."""

    dry_run: bool = False  # render and write the script and config, but do not call sbatch
