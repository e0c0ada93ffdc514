"""The whole job: run naming and output, and the JobConfig that holds every slice."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from areal_jobs.config.algo import AlgoConfig
from areal_jobs.config.cluster import ClusterConfig, ClusterKind, LaunchConfig
from areal_jobs.config.control import ControlConfig
from areal_jobs.config.data import DataConfig, ModelConfig
from areal_jobs.config.keys import unknown_key_message, unknown_keys
from areal_jobs.config.reward import RewardConfig
from areal_jobs.config.rollout import RolloutConfig, RolloutEngine
from areal_jobs.config.support import check_backend_support, check_lora_support
from areal_jobs.config.trainer import CheckpointConfig, RoutingReplay, TrainerConfig, WeightSyncConfig


@dataclass
class RunConfig:
    """Naming, output and observability of one run."""

    name: str = "tiny-arith"  # run directory name under run.root; the same name resumes that run
    root: str = "runs"  # run directory = <root>/<name>
    eval_every_steps: int = 50  # each evaluation is run.eval_samples + 1 answers per held-out prompt
    eval_samples: int = 4  # sampled answers per held-out prompt: pass@1 is their mean, pass@k from them
    eval_pass_k: int = 4  # the k of the eval/pass@k metric (<= run.eval_samples)
    log_level: str = "INFO"  # AREAL_JOBS_LOG_LEVEL overrides
    tensorboard: bool = True  # event files in RUN_DIR/tensorboard (`tensorboard --logdir runs`)
    samples_every_steps: int = 10  # RUN_DIR/samples.jsonl: a training batch's samples this often (0 = off)
    samples_print: int = 2  # the first few samples of each dump (training and every evaluation) logged
    # job token for the control channel and the servers' API key: AREAL_JOB_TOKEN in the launcher's
    # environment wins, then this, else one is generated (resolve_job_token). Never written to
    # config.yaml; prefer the environment (an override is on the launcher's command line)
    token: str = ""
    # run directory and everything the run writes (checkpoints included): 0700 / 0600 by default;
    # true gives the group read access (0750 / 0640, e.g. an ops team that reads the logs). The
    # job token file stays 0600 either way
    share_with_group: bool = False
    # the trainer logs a warning when this share of a step's tokens (mean of 5 steps) was already
    # outside the clip range before the step (trainer/objective/staleness_watch.py); 0 = never
    preclip_warn_fraction: float = 0.10

    def __post_init__(self) -> None:
        if not 0.0 <= self.preclip_warn_fraction <= 1.0:
            raise ValueError(
                f"run.preclip_warn_fraction={self.preclip_warn_fraction}: a share of tokens in [0, 1] (0 = no warning)"
            )
        if self.eval_samples < 1:
            raise ValueError("run.eval_samples must be >= 1 (answers per held-out prompt)")
        if not 1 <= self.eval_pass_k <= self.eval_samples:
            raise ValueError("run.eval_pass_k must be in 1..run.eval_samples (pass@k needs k <= samples)")

    @property
    def dir(self) -> Path:
        return Path(self.root) / self.name

    @property
    def umask(self) -> int:
        """The umask every process of the run works under (run.share_with_group)."""
        return 0o027 if self.share_with_group else 0o077

    @property
    def dir_mode(self) -> int:
        return 0o777 & ~self.umask


TOKEN_ENV = "AREAL_JOB_TOKEN"


def resolve_job_token(run: RunConfig, environ: Mapping[str, str]) -> tuple[str, str]:
    """(token, where it came from): AREAL_JOB_TOKEN in the environment wins over run.token, which
    wins over a generated one ("" here: local mode generates it, a SLURM job at each attempt). The
    same rule for launch.local and launch.submit; the second value is for the launcher's log line."""
    if environ.get(TOKEN_ENV):
        return environ[TOKEN_ENV], f"{TOKEN_ENV} from the environment (it wins over run.token)"
    if run.token:
        return (
            run.token,
            f"run.token from the configuration (passed to the roles as {TOKEN_ENV}, never written to config.yaml)",
        )
    return "", "generated (neither AREAL_JOB_TOKEN nor run.token is set)"


class WandbMode(enum.Enum):
    auto = "auto"  # online when an API key is configured (WANDB_API_KEY or ~/.netrc), else offline
    online = "online"
    offline = "offline"  # RUN_DIR/wandb/offline-run-*: `wandb sync` it later


@dataclass
class LoggingConfig:
    """Trackers beside metrics.jsonl and TensorBoard (run.tensorboard); the same flat keys."""

    wandb: bool = False  # also log every metric to Weights & Biases
    wandb_project: str = "areal_jobs"  # the W&B project the run is logged to
    wandb_run_name: str = ""  # "" = run.name
    wandb_group: str = ""  # "" = none; e.g. one group per sweep
    wandb_mode: WandbMode = WandbMode.auto


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
    control: ControlConfig = field(default_factory=ControlConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        check_backend_support(self.algo, self.trainer.backend)
        check_lora_support(self.model.lora, self.trainer.backend)
        if self.algo.overlong_buffer >= self.rollout.max_new_tokens:
            raise ValueError("algo.overlong_buffer must be < rollout.max_new_tokens")
        if (
            self.trainer.routing_replay is RoutingReplay.rollout
            and self.rollout.engine is not RolloutEngine.vllm
        ):
            raise ValueError(
                f"trainer.routing_replay=rollout needs the engine's expert routes: rollout/engine="
                f"{self.rollout.engine.value} does not report them here (SGLang serves no MoE on CPU); "
                "set rollout/engine=vllm or trainer.routing_replay=off"
            )
        c = self.cluster
        if c.autoscale and c.kind is ClusterKind.local and c.autoscale_max_nodes < self.rollout.num_servers:
            raise ValueError(
                f"cluster.autoscale_max_nodes={c.autoscale_max_nodes} is below rollout.num_servers="
                f"{self.rollout.num_servers}: raise it (on cluster=local it counts rollout servers)"
            )


def register_configs() -> None:
    """Register the schema as Hydra's base config (conf/config.yaml lists it first)."""
    ConfigStore.instance().store(name="job_schema", node=JobConfig)


def to_job_config(cfg: Any) -> JobConfig:
    """DictConfig (from Hydra or a saved YAML) -> validated JobConfig objects. A key the schema
    lacks is refused (ValueError naming the closest real key): Hydra lets `+cluster.nodse=64` in,
    and building the dataclasses would drop it silently."""
    unknown = unknown_keys(cfg, JobConfig)
    if unknown:
        raise ValueError(unknown_key_message(unknown, JobConfig))
    merged = OmegaConf.merge(OmegaConf.structured(JobConfig), cfg)
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, JobConfig)
    return obj


CONFIG_HEADER = (
    "# run.token is never written here: the roles get the job token as AREAL_JOB_TOKEN from the launcher\n"
)


def save_job_config(cfg: JobConfig, path: Path) -> None:
    """Write the resolved config every role reads, with run.token blanked (the token travels in the
    environment only)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    node = OmegaConf.structured(cfg)
    node.run.token = ""
    path.write_text(CONFIG_HEADER + OmegaConf.to_yaml(node))


def load_job_config(path: str | Path) -> JobConfig:
    """Read a resolved config written by `save_job_config` (how every role process starts)."""
    return to_job_config(OmegaConf.load(str(path)))
