"""The few seams of the system, as small typed Protocols and value types.

Everything that crosses a component boundary inside one process is declared here; what crosses a
process boundary is in `transport/messages.py`. Implementations are chosen by config (Enum or
registry name) and each has a contract test that loads it the way production does.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # annotations only: this module imports no torch
    import torch

# ------------------------------------------------------------------------------------ rewards


class RewardStatus(enum.Enum):
    ok = "ok"  # the verifier ran and decided
    timeout = "timeout"  # the verifier or the sandboxed program ran past its limit
    sandbox_error = "sandbox_error"  # the sandbox itself failed (could not start, crashed)
    parse_error = "parse_error"  # no final answer could be extracted from the response
    # The grader itself is broken for this reference (its test does not compile, its prompt lacks
    # the entry point): says nothing about the response, so never count it as a wrong answer.
    grader_error = "grader_error"
    # The reward model gave no usable score: no answer by its deadline, a transport or server
    # error, an unparseable verdict. Says nothing about the response: the sample is counted and
    # left out of training (trainer/intake/batch.py), never scored as a 0.
    model_error = "model_error"
    # A user's reward function (reward.function, reward/user_fn.py) gave no usable score: it
    # raised (or its worker died), ran past reward.timeout_s, or returned no finite number. Says
    # nothing about the response: left out of training like model_error, never scored as a 0.
    fn_error = "fn_error"
    fn_timeout = "fn_timeout"
    fn_invalid = "fn_invalid"


# Samples with these statuses have no reward: trainer/intake/batch.py leaves them out of the group's
# advantages and of the loss.
UNSCORED_STATUSES = frozenset(
    s.value
    for s in (
        RewardStatus.model_error,
        RewardStatus.fn_error,
        RewardStatus.fn_timeout,
        RewardStatus.fn_invalid,
    )
)


@dataclass(frozen=True, slots=True)
class RewardRequest:
    """One response to score. `task` is a reward registry name (see reward/registry.py)."""

    task: str
    response: str
    reference: str  # gold answer, or a JSON test spec for code tasks
    prompt: str = ""  # the prompt as the policy saw it: what a reward model or judge reads with the response
    data_source: str = (
        ""  # the row's source (verl's `data_source`; a mixture's source name): routes the reward
    )
    extra_info: str = "{}"  # JSON object: the row's other fields, for a user's reward function


@dataclass(frozen=True, slots=True)
class RewardResult:
    reward: float
    status: RewardStatus = RewardStatus.ok
    detail: str = ""  # short, human-readable reason (never the untrusted output itself)
    # tool tasks only (reward/tool_python.py): the text the model reads, capped; untrusted
    output: str = ""
    # a user's reward function returning {"score": s, "<key>": v, ...}: the other numeric keys, as
    # (key, value) pairs (frozen, picklable); the reward service logs their means as reward/fn/<key>
    metrics: tuple[tuple[str, float], ...] = ()


class RewardFn(Protocol):
    """A reward function: pure, picklable by reference, runs inside a worker process."""

    def __call__(self, response: str, reference: str) -> RewardResult: ...


class RewardScorer(Protocol):
    """What the rollout controller awaits. Never blocks the event loop that drives generation."""

    async def score_group(self, requests: Sequence[RewardRequest]) -> list[RewardResult]: ...

    def metrics(self) -> dict[str, float]: ...


class ScoringClient(Protocol):
    """One reward-model server (reward.model.*), whatever the engine: rollout/reward_client.py.
    Both calls are reads, repeated after a transient failure up to the client's deadline; a
    failure that outlives it raises (the scorer turns it into RewardStatus.model_error)."""

    name: str

    async def classify(self, batch: Sequence[Sequence[int]]) -> list[list[float]]:
        """A discriminative model's logits (one row per input, one value per label)."""
        ...

    async def judge(self, rid: str, input_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """A generative judge's greedy verdict (its token ids) for one rendered prompt."""
        ...

    async def health(self) -> Health: ...

    async def close(self) -> None: ...


# ------------------------------------------------------------------------------------ rollout


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # end-of-sequence / end-of-turn ids (kept in the output)
    stop: tuple[str, ...] = ()  # stop strings (kept in the output: the policy learns to stop)
    # prefix-cache namespace: the controller passes the policy version, so a request never reuses
    # KV that older weights computed (pause_mode=in_place never flushes the cache: docs/protocols.md)
    cache_salt: str = ""


class FinishReason(enum.Enum):
    stop = "stop"
    length = "length"
    abort = "abort"


@dataclass(frozen=True, slots=True)
class GenerateResponse:
    """One /generate call's result. An aborted call returns its partial tokens."""

    output_ids: list[int]
    logprobs: list[float]  # behaviour log-probs, one per output token
    finish_reason: FinishReason
    weight_version: int  # the policy version every token of this segment was sampled under
    # trainer.routing_replay=rollout: the experts the engine routed this request's input positions
    # to (a mixture of experts); None when not asked for or not reported
    routes: ExpertRoutes | None = None


@dataclass(frozen=True, slots=True, eq=False)
class ExpertRoutes:
    """The experts one request's forward routed a run of positions to (routing replay).

    `ids[i, l, k]`: the k-th expert of decoder layer l at position `start + i` of the request's
    input + output tokens (uint8, or uint16 with 255+ experts; the dtype's all-ones value: no route).
    A position's experts are the ones computed when it was the model's input, i.e. while the
    next token was sampled: the last output token has none, a cached prompt prefix none either.
    """

    start: int
    ids: np.ndarray  # [rows, layers, top_k]


class Health(enum.Enum):
    """What one health probe of a rollout server found."""

    up = "up"
    no_answer = "no_answer"  # a timeout, an error status or a dropped connection: maybe only slow
    refused = "refused"  # nothing listens on the port: the server process is gone


class GenerationClient(Protocol):
    """Generation on one rollout server: what the controller's samples and evaluations use."""

    name: str

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        """Token ids in; token ids, behaviour log-probs and the weight version out. An aborted
        request returns its partial tokens (finish_reason abort)."""
        ...

    async def healthy(self) -> bool: ...

    async def health(self) -> Health:
        """One probe: up, no answer (maybe slow), or refused (gone)."""
        ...

    async def abort_all(self) -> None:
        """Abort every request on the server; each returns its partial tokens."""
        ...

    async def close(self) -> None: ...


class PauseControl(Protocol):
    """Pausing a server around a weight update. `mode` is a config.PauseMode value; the engine
    client maps it onto its own routes (SGLang: /pause_generation; vLLM: /pause?mode=...)."""

    async def pause(self, mode: str) -> None: ...

    async def resume(self) -> None: ...

    async def release_memory(self) -> None:
        """Free the engine's GPU memory (weights and KV cache) while the trainer uses the GPU
        (the colocated schedule); the server is idle and gets no request until resume_memory.
        Its weights come back with the next full weight update."""
        ...

    async def resume_memory(self) -> None: ...


class WeightReceiver(Protocol):
    """A server's half of the weight-update handshake: join the sender's broadcast group (ranks
    after the sender's rank 0), then begin / one call per flattened bucket / end. The trainer's
    side (weights/broadcast.py) is the same for every engine."""

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None: ...

    async def destroy_weights_update_group(self, group_name: str) -> None: ...

    async def begin_weight_update(self) -> None: ...

    async def update_weights_from_distributed(
        self, tensors: tuple[TensorSpec, ...], group_name: str, version: int
    ) -> None:
        """Receive one bucket (broadcast by the sender at the same time) and load it in place."""
        ...

    async def receive_encoded_bucket(
        self, tensors: tuple[TensorSpec, ...], group_name: str, version: int
    ) -> None:
        """The same for an encoded bucket (WeightSender.encoded: a delta or a full copy through
        weights/receiver.py inside the server, which applies it onto its copy and verifies it)."""
        ...

    async def end_weight_update(self) -> None:
        """After the last bucket: the server generates with the new weights at the new version."""
        ...

    async def flush_cache(self) -> None:
        """Drop cached prefixes computed with old weights (abort and drain pause modes)."""
        ...

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """Fallback: load a Hugging Face checkpoint directory."""
        ...

    async def weight_version(self) -> int:
        """The policy version the server generates with now."""
        ...

    async def load_lora_adapter(self, path: str, version: int) -> None:
        """model.lora.ship=adapter: load the PEFT directory `path` as `version`'s adapter; every
        request sent from now on generates with it and reports `version` for all its tokens."""
        ...


@runtime_checkable
class RolloutEngineClient(GenerationClient, PauseControl, WeightReceiver, Protocol):
    """One rollout server as the controller sees it, whatever the engine (SGLang or vLLM;
    rollout/engine=...). The controller and the weight-update orchestrator speak only this."""


# ------------------------------------------------------------------------------------ weights


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str  # Hugging Face parameter name, exactly as in a safetensors checkpoint
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One flattened broadcast: its tensors, in order, as raw bytes back to back."""

    index: int
    tensors: tuple[TensorSpec, ...]


@dataclass(frozen=True, slots=True)
class WeightSender:
    """One trainer rank that broadcasts buckets to every server over its own process group.

    The sender is rank 0 of its group (SGLang receives with src=0); servers take the ranks after
    it. The torch backend has one sender; Megatron has one per pipeline stage.
    """

    group_name: str
    master_address: str  # the sender hosts the group's TCP store
    master_port: int
    buckets: tuple[BucketSpec, ...]
    # weight_sync.sync=delta: every bucket goes through our receiver (header, payload, status;
    # weights/receiver.py), not the engine's own bucket route
    encoded: bool = False


# ------------------------------------------------------------------------------------ trainer
# Built from trajectory groups by trainer/intake/batch.py; per sample: input_ids [L] = prompt [p] +
# output [n]; behav_logprobs and versions are [n].


@dataclass(frozen=True)
class TrainSample:
    sample_id: str
    input_ids: np.ndarray  # int64 [p + n]
    num_prompt_tokens: int  # p
    behav_logprobs: np.ndarray  # float32 [n]
    versions: np.ndarray  # int32 [n]
    advantage: float
    reward: float
    loss_mask: np.ndarray | None = None  # uint8 [n], 0 = not trained (algo.mask_truncated); None = all 1
    # trainer.routing_replay=rollout: the engine's experts [p + n, layers, top_k] (transport/routes.py)
    routes: np.ndarray | None = None

    @property
    def num_output_tokens(self) -> int:
        return int(self.behav_logprobs.shape[0])

    def mask(self) -> np.ndarray:
        """float32 [n]: 1 on trained output tokens."""
        if self.loss_mask is None:
            return np.ones(self.num_output_tokens, dtype=np.float32)
        return self.loss_mask.astype(np.float32)


@dataclass
class TrainBatch:
    version: int  # trainer policy version the batch is trained at (produces version + 1)
    samples: list[TrainSample]
    group_ids: list[str]
    filtered_group_ids: list[str] = field(default_factory=list)  # uniform rewards, no signal
    unscored_samples: int = 0  # left out: their reward failed (UNSCORED_STATUSES)
    max_new_tokens: int = 0  # the rollout's length cap: algo.loss_agg=seq_mean_token_sum_norm divides by it

    @property
    def num_output_tokens(self) -> int:
        return sum(s.num_output_tokens for s in self.samples)

    def staleness(self) -> np.ndarray:
        """Per trained token: versions behind the trainer. int32 [sum n]."""
        if not self.samples:
            return np.zeros(0, dtype=np.int32)
        return self.version - np.concatenate([s.versions for s in self.samples])


class TrainBackend(Protocol):
    """A trainer backend (torch or Megatron): same batches in, same loss, weights out.

    Every method is called on every trainer rank at the same time (they may be collective).
    """

    def train_step(self, batch: TrainBatch | None) -> dict[str, float]:
        """Recompute proximal log-probs, then one decoupled-PPO optimiser step.

        Rank 0 passes the batch; other ranks pass None and get their share from rank 0.
        Returns flat metrics (meaningful on rank 0).
        """
        ...

    def weight_specs(self) -> list[TensorSpec]:
        """The tensors this rank broadcasts, with HF names (empty on ranks that send nothing)."""
        ...

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) HF-named tensors in `weight_specs` order; yields only on senders."""
        ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def save_hf(self, path: str) -> None:
        """A Hugging Face checkpoint (config.json + safetensors) of the current policy."""
        ...
