"""Rollout servers and the asyncio controller that drives them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from areal_jobs.config.data import DType


class RolloutEngine(enum.Enum):
    """The inference engine behind every rollout server (conf group `rollout/engine`)."""

    sglang = "sglang"
    vllm = "vllm"


class PauseMode(enum.Enum):
    abort = "abort"  # interrupt, return partial tokens, re-send prompt + partial output
    # freeze requests and keep their (old-weight) KV cache; the default: no re-prefill after an
    # update (make bench: the only mode that reaches the overlap bound; soundness: docs/protocols.md)
    in_place = "in_place"
    drain = "drain"  # stop admitting and wait for in-flight requests to finish


class ServingDType(enum.Enum):
    """The dtype the rollout servers hold the policy in (rollout.dtype)."""

    # bfloat16 where the servers run on GPUs (what clusters serve; the trainer keeps model.dtype
    # masters and ships the rounded copy), model.dtype on CPU, so CPU runs stay exact
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def serving_dtype(rollout_dtype: ServingDType, model_dtype: DType, gpu: bool) -> DType:
    """What the servers hold (pure): `rollout.dtype`, or for `auto` bfloat16 on GPUs (float16 for
    a float16 model) and model.dtype on CPU. The trainer casts its weights to this before sending;
    the servers start with it (--dtype)."""
    if rollout_dtype is not ServingDType.auto:
        return DType(rollout_dtype.value)
    if not gpu:
        return model_dtype
    return DType.float16 if model_dtype is DType.float16 else DType.bfloat16


# rollout.workflow.name: the registry's names (agent/registry.py; a unit test keeps the two equal).
# The config layer imports no workflow code, so the names are listed here too.
WORKFLOW_NAMES = ("single_turn", "multi_turn_math", "tool_arith", "openai_agent")


@dataclass
class WorkflowConfig:
    """What one episode of one prompt is (conf group `rollout/workflow`; docs/protocols.md)."""

    name: str = "single_turn"  # a WORKFLOW_NAMES entry, or "module:function" of your own workflow
    max_turns: int = 3  # multi-turn workflows: model turns per episode
    turn_discount: float = 0.5  # multi_turn_math: reward of a right answer at turn t = discount**t
    # cap on all episode tokens (model + environment: the trainer's sequence is prompt + these);
    # 0 = none beyond max_turns * rollout.max_new_tokens model tokens (each turn's own cap)
    max_episode_tokens: int = 0
    max_tool_calls: int = 4  # tool workflows: calls per episode
    tool_timeout_s: float = 5.0  # tool workflows: one tool call's time limit
    tool_output_chars: int = 512  # a tool's result is cut to this many characters
    agent: str = ""  # openai_agent: "module:function" of the user's agent
    # openai_agent: where its OpenAI-compatible endpoint listens, inside the controller process,
    # where the agents run too: 127.0.0.1 is right on SLURM as well; port 0 = a free one
    endpoint_host: str = "127.0.0.1"
    endpoint_port: int = 0  # openai_agent: the endpoint's port (0 = a free one)

    def __post_init__(self) -> None:
        if self.name not in WORKFLOW_NAMES and ":" not in self.name:
            raise ValueError(
                f"rollout.workflow.name={self.name!r}: expected one of {list(WORKFLOW_NAMES)} "
                "(rollout/workflow=<name>) or a 'module:function'"
            )
        if self.max_turns < 1 or self.max_tool_calls < 0 or self.max_episode_tokens < 0:
            raise ValueError(
                "rollout.workflow.max_turns must be >= 1, rollout.workflow.max_tool_calls and "
                "rollout.workflow.max_episode_tokens >= 0"
            )
        if not 0.0 <= self.turn_discount <= 1.0:
            raise ValueError("rollout.workflow.turn_discount must be in [0, 1]")
        if self.tool_timeout_s <= 0 or self.tool_output_chars < 1:
            raise ValueError(
                "rollout.workflow.tool_timeout_s must be > 0 and rollout.workflow.tool_output_chars >= 1"
            )


@dataclass
class RolloutConfig:
    """Rollout servers and the asyncio controller that drives them."""

    engine: RolloutEngine = RolloutEngine.sglang  # choose with rollout/engine=sglang|vllm
    # interpreter that runs the engine server; "" = the engine's default (vllm: .venv-vllm/bin/python
    # of the checkout when it exists, else this interpreter; sglang: this interpreter)
    engine_python: str = ""
    num_servers: int = 1  # local mode: servers started by launch.local
    tp_size: int = 1  # GPUs per server (cluster mode)
    max_new_tokens: int = 256  # answer length cap per sample (a longer answer is truncated)
    # the behaviour policy is softmax(logits / temperature): servers return log-probs of it and the
    # trainer's loss computes the same (docs/objective.md)
    temperature: float = 1.0
    top_p: float = 1.0  # < 1 is refused: see __post_init__
    max_concurrent: int = 128  # in-flight requests (samples) across all servers
    # the servers' weight dtype: auto = bfloat16 on GPUs, model.dtype on CPU (serving_dtype); the
    # trainer keeps model.dtype masters and ships the rounded copy (docs/weight-sync.md)
    dtype: ServingDType = ServingDType.auto
    pause_mode: PauseMode = PauseMode.in_place
    request_timeout_s: float = 600.0  # one /generate call (a long answer on a slow CPU)
    call_timeout_s: float = 60.0  # control calls: pause, continue, health, weight-update steps
    server_start_timeout_s: float = (
        300.0  # a starting server with no progress (CPU, log) this long is given up on
    )
    health_interval_s: float = 5.0  # how often the controller probes each server
    max_server_restarts: int = 3  # local mode: a server that dies is restarted this often per run
    max_total_tokens: int = 32768  # server KV-cache capacity in tokens (CPU mode)
    kv_cache_gib: float = 1.0  # vllm on CPU: KV-cache size (VLLM_CPU_KVCACHE_SPACE); GPUs size it themselves
    server_threads: int = 1  # torch threads per server process (CPU mode)
    # CPU mode, SGLang: its scheduler and detokenizer processes are forked from the started server,
    # not spawned, so they do not import torch and SGLang again (start-up 2.2x faster on 2 cores;
    # rollout/sglang_launch.py); false = SGLang's own spawn. GPU servers always spawn
    sglang_cpu_fork: bool = True
    base_port: int = 0  # server i listens on base_port + i; 0 = any free port (local mode)
    controller_port: int = 0  # controller binds this (trajectories) and +1 (control); 0 = free
    extra_server_args: list[str] = field(default_factory=list)  # appended to the engine's command line
    # stop strings beside the model's end-of-sequence / end-of-turn tokens (which come from the
    # tokenizer and generation_config.json), e.g. ["</answer>"]; a sample records stop or length
    stop: list[str] = field(default_factory=list)
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)  # rollout/workflow=<name>
    # share of each of its GPUs' memory a server may hold (SGLang --mem-fraction-static: weights +
    # KV cache; vLLM --gpu-memory-utilization); 0 = the engine's default, for a server that has its
    # GPUs to itself. The planner sets it where servers share GPUs with each other or the trainer
    # (colocated, launch.local on a GPU machine: launch/planning/fit/gpu_shares.py); GPU machines only
    gpu_memory_fraction: float = 0.0
    # the synchronous colocated schedule: the servers free their GPU memory (SGLang
    # release_memory_occupation, vLLM sleep) once a batch is generated, while the trainer steps,
    # and take it back for the weight update; set by cluster.placement=colocated
    release_memory_while_training: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.gpu_memory_fraction < 1.0:
            raise ValueError(
                "rollout.gpu_memory_fraction must be in [0, 1): a server's share of each GPU's memory "
                "(0 = the engine's default), e.g. rollout.gpu_memory_fraction=0.4"
            )
        if self.kv_cache_gib <= 0:
            raise ValueError("rollout.kv_cache_gib must be > 0 (vLLM's KV cache on CPU, in GiB)")
        if self.temperature <= 0:
            raise ValueError("rollout.temperature must be > 0 for RL sampling")
        if self.top_p != 1.0:
            # nucleus sampling draws from a truncated, renormalised distribution: SGLang's log-probs
            # would be of the untruncated one, vLLM's of the truncated one, and the trainer's of
            # the untruncated one, so the behaviour weight would silently compare different things
            raise ValueError(
                f"rollout.top_p={self.top_p}: the trainer's log-probs are of the whole softmax of "
                "logits / rollout.temperature, not of a top-p nucleus, so the behaviour policy "
                "would not be the one the loss assumes: set rollout.top_p=1.0 (lower "
                "rollout.temperature to sharpen sampling instead)"
            )
        if self.max_concurrent < 1 or self.num_servers < 1 or self.tp_size < 1:
            raise ValueError("rollout.max_concurrent, rollout.num_servers and rollout.tp_size must be >= 1")
