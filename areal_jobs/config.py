"""Configuration schema: one dataclass per component, registered in Hydra's ConfigStore.

YAML files under conf/ only select and override these. Choices are Enums (OmegaConf 2.3 rejects
`Literal`). Cross-field checks live in `__post_init__` and name the override that fixes them.
`main` converts the DictConfig to these objects once (`to_job_config`) and passes each
component only its own slice.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

# --------------------------------------------------------------------------------------- enums


class Dataset(enum.Enum):
    arith = "arith"  # the built-in, code-generated multi-step arithmetic task
    gsm8k = "gsm8k"  # GSM8K-style JSONL: {"question", "answer"} with "#### <answer>"
    math = "math"  # MATH-style JSONL: {"problem", "solution"} with \boxed{...}
    humaneval = "humaneval"  # HumanEval JSONL: prompt + check(candidate) tests
    code_stdio = "code_stdio"  # JSONL: {"prompt", "tests": [{"input", "output"}]}


class RolloutBackend(enum.Enum):
    sglang = "sglang"
    vllm = "vllm"


class PauseMode(enum.Enum):
    abort = "abort"  # interrupt, return partial tokens, re-send prompt + partial output
    in_place = "in_place"  # freeze requests and keep their (old-weight) KV cache
    drain = "drain"  # stop admitting and wait for in-flight requests to finish


class Advantage(enum.Enum):
    grpo = "grpo"  # (r - mean) / (std + eps) within the group
    drgrpo = "drgrpo"  # r - mean (Dr.GRPO: no std normalisation)
    rloo = "rloo"  # r - mean of the other G-1 samples


class TrainerBackend(enum.Enum):
    torch = "torch"  # Hugging Face model class, plain torch (CPU and small runs)
    megatron = "megatron"  # Megatron-Core GPTModel with TP/PP/DP


class WeightSync(enum.Enum):
    distributed = "distributed"  # torch.distributed broadcast (NCCL on GPU, gloo on CPU)
    disk = "disk"  # safetensors checkpoint + /update_weights_from_disk


class DistBackend(enum.Enum):
    auto = "auto"  # nccl when CUDA is available, else gloo
    nccl = "nccl"
    gloo = "gloo"


class ClusterKind(enum.Enum):
    local = "local"  # every process on this machine, started by launch.local
    slurm = "slurm"  # one heterogeneous SLURM job rendered by launch.render


class NetworkIsolation(enum.Enum):
    auto = "auto"  # a network namespace when permitted, else rlimits + scrubbed env only
    netns = "netns"  # require a network namespace (fail if it cannot be created)
    none = "none"  # no network isolation (trusted code only)


class DType(enum.Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


# --------------------------------------------------------------------------------------- slices


@dataclass
class ModelConfig:
    """Which policy to train: an HF directory (config.json + safetensors + tokenizer)."""

    path: str = ""  # HF model directory; empty = the built-in tiny model (built on first use)
    dtype: DType = DType.float32  # parameter dtype in trainer and rollout servers
    builtin_dir: str = "areal_jobs/data/builtin_model"  # the committed warm start; another dir builds one
    builtin_sft_steps: int = 2000  # phase-1 warm-start steps (a different value needs another builtin_dir)

    def __post_init__(self) -> None:
        if self.builtin_sft_steps < 0:
            raise ValueError("model.builtin_sft_steps must be >= 0")


@dataclass
class DataConfig:
    """Prompts for training and held-out evaluation."""

    dataset: Dataset = Dataset.arith
    train_path: str = ""  # JSONL for file datasets; unused for the built-in task
    eval_path: str = ""  # held-out JSONL; empty = split from train (file datasets) / generated
    num_eval_prompts: int = 256  # held-out prompts scored at start, every eval interval, and end
    max_prompt_tokens: int = 512  # longer prompts are skipped and counted (file and line reported)
    seed: int = 1  # prompt order; the same seed replays the same prompt sequence after resume

    def __post_init__(self) -> None:
        if self.dataset is not Dataset.arith and not self.train_path:
            raise ValueError(f"data.dataset={self.dataset.value} needs data.train_path=<file.jsonl>")
        if self.num_eval_prompts < 0:
            raise ValueError("data.num_eval_prompts must be >= 0")


@dataclass
class AlgoConfig:
    """Staleness-bounded decoupled PPO (AReaL)."""

    max_staleness: int = 4  # eta: max policy versions between sampling a token and training on it
    batch_size: int = 8  # B: prompt groups per training step
    group_size: int = 8  # G: sampled answers per prompt
    advantage: Advantage = Advantage.grpo
    clip_eps: float = 0.2  # PPO clip on r = exp(logp - prox_logp)
    decoupled: bool = True  # False: proximal = behaviour log-probs (standard PPO ablation)
    behav_weight_cap: float = 0.0  # >0: drop tokens whose exp(prox - behav) exceeds it
    filter_uniform_groups: bool = False  # drop groups whose rewards are all equal (no signal)
    ppo_minibatches: int = 1  # optimiser steps per batch; the clip keeps later ones near the proximal policy

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError("algo.max_staleness must be >= 0 (0 = synchronous)")
        if self.batch_size < 1:
            raise ValueError("algo.batch_size must be >= 1")
        if self.group_size < 2 and self.advantage is not Advantage.drgrpo:
            raise ValueError(
                f"algo.advantage={self.advantage.value} normalises within a group: set "
                "algo.group_size>=2 or algo.advantage=drgrpo"
            )
        if not 0.0 < self.clip_eps < 1.0:
            raise ValueError("algo.clip_eps must be in (0, 1)")
        if not 1 <= self.ppo_minibatches <= self.batch_size * self.group_size:
            raise ValueError("algo.ppo_minibatches must be in [1, algo.batch_size * algo.group_size]")


@dataclass
class RolloutConfig:
    """Rollout servers and the asyncio controller that drives them."""

    backend: RolloutBackend = RolloutBackend.sglang
    num_servers: int = 1  # local mode: servers started by launch.local
    tp_size: int = 1  # GPUs per server (cluster mode)
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    max_concurrent: int = 128  # in-flight requests (samples) across all servers
    pause_mode: PauseMode = PauseMode.abort
    request_timeout_s: float = 600.0  # one /generate call (a long answer on a slow CPU)
    call_timeout_s: float = 60.0  # control calls: pause, continue, health, weight-update steps
    server_start_timeout_s: float = 300.0
    health_interval_s: float = 5.0
    max_server_restarts: int = 3  # local mode: a server that dies is restarted this often per run
    max_total_tokens: int = 32768  # server KV-cache capacity in tokens (CPU mode)
    server_threads: int = 1  # torch threads per server process (CPU mode)
    base_port: int = 0  # server i listens on base_port + i; 0 = any free port (local mode)
    controller_port: int = 0  # controller binds this (trajectories) and +1 (control); 0 = free
    extra_server_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.backend is RolloutBackend.vllm:
            raise ValueError("rollout.backend=vllm is not implemented yet: use rollout.backend=sglang")
        if self.temperature <= 0:
            raise ValueError("rollout.temperature must be > 0 for RL sampling")
        if self.max_concurrent < 1 or self.num_servers < 1 or self.tp_size < 1:
            raise ValueError("rollout.max_concurrent, rollout.num_servers and rollout.tp_size must be >= 1")


@dataclass
class TrainerConfig:
    """Policy optimisation: the backend, optimiser, packing and parallel layout."""

    backend: TrainerBackend = TrainerBackend.torch
    total_steps: int = 100
    lr: float = 3e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0
    max_tokens_per_microbatch: int = 1024  # packing budget; every micro-batch gets about the same
    threads: int = 1  # torch threads per trainer process (CPU mode)
    seed: int = 1
    tp_size: int = 1  # megatron only
    pp_size: int = 1  # megatron only
    dp_size: int = 1  # megatron only; trainer processes = tp * pp * dp
    megatron_vocab_multiple: int = 128  # megatron only: vocab padded to a multiple of this; tp must divide it
    batch_wait_timeout_s: float = 1800.0  # no trajectories for this long = rollout side is dead

    def __post_init__(self) -> None:
        if self.backend is TrainerBackend.torch and self.tp_size * self.pp_size * self.dp_size != 1:
            raise ValueError("trainer.backend=torch runs one process: use trainer=megatron for TP/PP/DP")
        if self.total_steps < 1:
            raise ValueError("trainer.total_steps must be >= 1")
        if self.max_tokens_per_microbatch < 16:
            raise ValueError("trainer.max_tokens_per_microbatch must be >= 16")
        if self.megatron_vocab_multiple % self.tp_size:  # megatron: padded vocab splits evenly over TP
            raise ValueError(
                f"trainer.megatron_vocab_multiple must be a multiple of trainer.tp_size={self.tp_size}"
            )


@dataclass
class WeightSyncConfig:
    """How new weights reach the rollout servers after every step."""

    method: WeightSync = WeightSync.distributed
    backend: DistBackend = DistBackend.auto
    bucket_bytes: int = 1 << 30  # weights are sent in flattened buckets of at most this size
    master_port: int = 0  # 0 = pick a free port (local); set in cluster mode
    step_timeout_s: float = 120.0  # each handshake step (pause, group init, bucket, resume)


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


@dataclass
class CheckpointConfig:
    """Periodic and on-signal checkpoints; resume from the newest one."""

    every_steps: int = 0  # 0 = only at the end and on SIGUSR1/SIGTERM
    keep_last: int = 2
    resume: bool = True  # resume from runs/<name>/checkpoints when present


# SLURM --time: "M", "M:S", "H:M:S", "D-H", "D-H:M", "D-H:M:S"
_SLURM_TIME = re.compile(r"^(\d+-\d+(:\d+){0,2}|\d+(:\d+){0,2})$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class ClusterConfig:
    """Where the job runs. Cluster mode renders one heterogeneous SLURM job (launch/plan.py
    decides the layout, launch/render.py writes the script); local mode runs launch.local."""

    kind: ClusterKind = ClusterKind.local
    nodes: int = 1  # total nodes of the heterogeneous job (rollout + trainer)
    gpus_per_node: int = 8  # GPUs requested on every node (--gres=gpu:N)
    # share of nodes that run rollout servers (rounded down), or "auto": launch.plan_allocation
    # simulates the job under `allocation_profile` and picks the split with the highest throughput.
    # A string so that "auto" is accepted; numbers are normalised and checked in __post_init__.
    rollout_fraction: str = "0.75"
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
    nccl_env: dict[str, str] = field(default_factory=dict)  # NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ...

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError("cluster.nodes must be >= 1")
        if self.gpus_per_node < 1:
            raise ValueError("cluster.gpus_per_node must be >= 1")
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
        if not 0 < self.master_port < 65536:
            raise ValueError("cluster.master_port must be a TCP port in [1, 65535]")
        bad = [key for key in self.nccl_env if not _ENV_NAME.match(key)]
        if bad:
            raise ValueError(f"cluster.nccl_env has keys that are not environment variable names: {bad}")

    @property
    def rollout_fraction_auto(self) -> bool:
        return self.rollout_fraction == "auto"

    @property
    def rollout_share(self) -> float:
        """The numeric rollout fraction; `auto` must have been resolved (launch.plan does it)."""
        if self.rollout_fraction_auto:
            raise ValueError(
                "cluster.rollout_fraction=auto is resolved by launch.plan.plan_job, not read directly"
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


@dataclass
class RunConfig:
    """Naming, output and observability of one run."""

    name: str = "tiny-arith"
    root: str = "runs"  # run directory = <root>/<name>
    eval_every_steps: int = 20
    log_level: str = "INFO"  # AREAL_JOBS_LOG_LEVEL overrides
    tensorboard: bool = True
    token: str = ""  # job token for the control channel and API key; empty = generated

    @property
    def dir(self) -> Path:
        return Path(self.root) / self.name


@dataclass
class JobConfig:
    """The whole job. Each component is handed only its own slice."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)


def register_configs() -> None:
    """Register the schema as Hydra's base config (conf/config.yaml lists it first)."""
    ConfigStore.instance().store(name="job_schema", node=JobConfig)


def to_job_config(cfg: Any) -> JobConfig:
    """DictConfig (from Hydra or a saved YAML) -> validated JobConfig objects."""
    merged = OmegaConf.merge(OmegaConf.structured(JobConfig), cfg)
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, JobConfig)
    return obj


def save_job_config(cfg: JobConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def load_job_config(path: str | Path) -> JobConfig:
    """Read a resolved config written by `save_job_config` (how every role process starts)."""
    return to_job_config(OmegaConf.load(str(path)))
