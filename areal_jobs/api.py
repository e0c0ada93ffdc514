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


@dataclass(frozen=True, slots=True)
class RewardRequest:
    """One response to score. `task` is a reward registry name (see reward/registry.py)."""

    task: str
    response: str
    reference: str  # gold answer, or a JSON test spec for code tasks


@dataclass(frozen=True, slots=True)
class RewardResult:
    reward: float
    status: RewardStatus = RewardStatus.ok
    detail: str = ""  # short, human-readable reason (never the untrusted output itself)


class RewardFn(Protocol):
    """A reward function: pure, picklable by reference, runs inside a worker process."""

    def __call__(self, response: str, reference: str) -> RewardResult: ...


class RewardScorer(Protocol):
    """What the rollout controller awaits. Never blocks the event loop that drives generation."""

    async def score_group(self, requests: Sequence[RewardRequest]) -> list[RewardResult]: ...

    def metrics(self) -> dict[str, float]: ...


# ------------------------------------------------------------------------------------ rollout


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


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


@runtime_checkable
class RolloutBackendClient(Protocol):
    """A rollout server as the controller sees it (SGLang today; vLLM later)."""

    name: str

    async def generate(self, request: GenerateRequest) -> GenerateResponse: ...

    async def pause(self, mode: str) -> None: ...

    async def resume(self) -> None: ...

    async def healthy(self) -> bool: ...


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


# ------------------------------------------------------------------------------------ trainer
# Built from trajectory groups by trainer/batch.py; per sample: input_ids [L] = prompt [p] +
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

    @property
    def num_output_tokens(self) -> int:
        return int(self.behav_logprobs.shape[0])


@dataclass
class TrainBatch:
    version: int  # trainer policy version the batch is trained at (produces version + 1)
    samples: list[TrainSample]
    group_ids: list[str]
    filtered_group_ids: list[str] = field(default_factory=list)  # uniform rewards, no signal

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
