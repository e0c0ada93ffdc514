"""Configuration schema: one dataclass per component, registered in Hydra's ConfigStore.

One module per role (`data`, `algo`, `rollout`, `trainer`, `reward`, `cluster`) and `job` for the
whole. YAML files under conf/ only select and override these. Choices are Enums (OmegaConf 2.3
rejects `Literal`). Cross-field checks live in `__post_init__` and name the override that fixes
them. `main` converts the DictConfig to these objects once (`to_job_config`) and passes each
component only its own slice. Everything is re-exported here: `from areal_jobs.config import X`.
"""

from areal_jobs.config.algo import Advantage, AlgoConfig
from areal_jobs.config.cluster import ClusterConfig, ClusterKind, LaunchConfig, Placement
from areal_jobs.config.control import ControlConfig
from areal_jobs.config.data import DataConfig, DataFormat, Dataset, DType, ModelConfig, SourceConfig
from areal_jobs.config.job import (
    TOKEN_ENV,
    JobConfig,
    LoggingConfig,
    RunConfig,
    WandbMode,
    load_job_config,
    register_configs,
    resolve_job_token,
    save_job_config,
    to_job_config,
)
from areal_jobs.config.keys import check_override_keys, closest_key, schema_keys, unknown_keys
from areal_jobs.config.lora import LoraConfig, LoraFinal, LoraShip
from areal_jobs.config.reward import FunctionIsolation, NetworkIsolation, RewardConfig, RewardSource
from areal_jobs.config.reward_model import (
    RewardModelConfig,
    RewardModelInput,
    RewardModelKind,
    ScoreTransform,
    VerdictParser,
)
from areal_jobs.config.rollout import (
    PauseMode,
    RolloutConfig,
    RolloutEngine,
    ServingDType,
    WorkflowConfig,
    serving_dtype,
)
from areal_jobs.config.trainer import (
    Attention,
    CheckpointConfig,
    DistBackend,
    LogprobKernel,
    Recompute,
    RoutingReplay,
    SyncMode,
    TrainerBackend,
    TrainerConfig,
    WeightSync,
    WeightSyncConfig,
)

__all__ = [
    "Advantage",
    "FunctionIsolation",
    "AlgoConfig",
    "Attention",
    "CheckpointConfig",
    "ClusterConfig",
    "ClusterKind",
    "ControlConfig",
    "Placement",
    "DType",
    "DataConfig",
    "DataFormat",
    "Dataset",
    "DistBackend",
    "JobConfig",
    "LaunchConfig",
    "LogprobKernel",
    "LoraConfig",
    "LoraFinal",
    "LoraShip",
    "ModelConfig",
    "NetworkIsolation",
    "PauseMode",
    "Recompute",
    "RoutingReplay",
    "RewardConfig",
    "RewardModelConfig",
    "RewardModelInput",
    "RewardModelKind",
    "RewardSource",
    "ScoreTransform",
    "VerdictParser",
    "RolloutConfig",
    "RolloutEngine",
    "LoggingConfig",
    "RunConfig",
    "ServingDType",
    "SourceConfig",
    "SyncMode",
    "TOKEN_ENV",
    "WandbMode",
    "TrainerBackend",
    "TrainerConfig",
    "WeightSync",
    "WeightSyncConfig",
    "WorkflowConfig",
    "check_override_keys",
    "closest_key",
    "load_job_config",
    "register_configs",
    "resolve_job_token",
    "save_job_config",
    "schema_keys",
    "serving_dtype",
    "to_job_config",
    "unknown_keys",
]
