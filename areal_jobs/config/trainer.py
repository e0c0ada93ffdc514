"""The trainer: backend, optimiser and layout; weight sync; checkpoints."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TrainerBackend(enum.Enum):
    torch = "torch"  # Hugging Face model class, plain torch (CPU and small runs)
    megatron = "megatron"  # Megatron-Core GPTModel with TP/PP/DP
    fsdp = "fsdp"  # Hugging Face model sharded with torch FSDP2 (fully_shard), DP ranks only


class Attention(enum.Enum):
    """How a packed micro-batch (several sequences in one row) is attended to."""

    # each sequence attends causally to itself only, computed sequence by sequence from the
    # packing boundaries (cu_seqlens): cost proportional to the sum of squared lengths, no [T, T]
    # mask. TransformerEngine's THD attention when it is installed (Megatron on GPU).
    varlen = "varlen"
    # one block-diagonal causal [T, T] mask over the whole row (the former path, kept so a
    # benchmark or a test can put both side by side): cost and memory T squared
    dense = "dense"
    # CUDA only: torch's varlen_attn (FlashAttention-2 in libtorch), all sequences in one kernel
    # from cu_seqlens; refused on CPU, where libtorch has no such kernel
    varlen_attn = "varlen_attn"
    # CUDA only: compiled FlexAttention with a document-causal block mask built once per
    # micro-batch from cu_seqlens (the packed length bucketed to 512 tokens); refused on CPU, where
    # FlexAttention has no backward
    flex = "flex"


class LogprobKernel(enum.Enum):
    """The softmax side of the chunked LM head (trainer/forward/logprobs.py)."""

    auto = "auto"  # triton on CUDA when Triton is importable, torch otherwise (CPU)
    triton = "triton"  # two fused Triton kernels per chunk (trainer/forward/logprob_kernels.py)
    torch = "torch"  # torch ops over float32 [chunk, V] logits


class Recompute(enum.Enum):
    """Activation recomputation in the backward pass: less memory for more compute."""

    none = "none"  # keep every activation
    # Megatron only: recompute the core attention (Megatron's selective granularity)
    selective = "selective"
    full = "full"  # keep only each decoder layer's input, recompute the layer in backward


class RoutingReplay(enum.Enum):
    """Which experts the trainer's forward routes each token of a mixture of experts to."""

    off = "off"  # the trainer's own router top-k (the engine may have picked other experts)
    # the experts the rollout engine picked for each position, reported with the sample; the
    # router's probabilities are still the trainer's, gathered at those experts (docs/moe.md)
    rollout = "rollout"


class WeightSync(enum.Enum):
    distributed = "distributed"  # torch.distributed broadcast (NCCL on GPU, gloo on CPU)
    disk = "disk"  # safetensors checkpoint + /update_weights_from_disk


class SyncMode(enum.Enum):
    """What one distributed weight update carries (weight_sync.sync)."""

    full = "full"  # every tensor, every update (SGLang's and vLLM's own bucket loads)
    # only the elements whose bits changed since the version every server holds (positions and
    # values, checksummed per bucket; a full copy every weight_sync.full_every versions and
    # whenever a server does not hold that version): docs/weight-sync.md
    delta = "delta"


class DistBackend(enum.Enum):
    auto = "auto"  # nccl when CUDA is available, else gloo
    nccl = "nccl"
    gloo = "gloo"


@dataclass
class TrainerConfig:
    """Policy optimisation: the backend, optimiser, packing and parallel layout."""

    backend: TrainerBackend = TrainerBackend.torch
    total_steps: int = 100  # training steps (one batch of algo.batch_size groups each)
    lr: float = 1.5e-4  # built-in task: 3e-4 unlearned its misconception but could break the "+" token
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    adam_beta1: float = 0.9  # AdamW's first-moment decay
    adam_beta2: float = 0.999  # AdamW's second-moment decay
    grad_clip: float = 1.0  # global gradient-norm clip per step
    max_tokens_per_microbatch: int = 1024  # packing budget; every micro-batch gets about the same
    # log-probs and entropy through the LM head this many tokens at a time (trainer/forward/logprobs.py): no
    # [tokens, vocab] float32 logits; 0 = all scored tokens at once through plain autograd (the old path)
    logprob_chunk_tokens: int = 1024
    logprob_kernel: LogprobKernel = LogprobKernel.auto
    threads: int = 1  # torch threads per trainer process (CPU mode)
    seed: int = 1  # the trainer's random seed
    tp_size: int = 1  # megatron only
    pp_size: int = 1  # megatron only
    dp_size: int = 1  # megatron and fsdp; trainer processes = tp * pp * dp
    # megatron only, mixture-of-experts models: expert parallelism (expert_model_parallel_size)
    # splits each layer's experts over ep_size ranks, each expert's weights split over
    # expert_tp_size (expert_tensor_parallel_size); the expert grid ETP x EP x EDP folds onto the
    # same TP x DP ranks (Megatron's parallel folding), so ETP x EP must divide TP x DP. ETP 1 as
    # slime's and verl's Qwen3-MoE recipes use: experts are narrow (768 for Qwen3-30B-A3B), their
    # GEMMs gain nothing from a TP split. docs/memory.md "Mixtures of experts"
    ep_size: int = 1
    expert_tp_size: int = 1
    # mixture-of-experts policies: the weight of the router's load-balancing loss in the trainer's
    # loss (trainer/objective/router_loss.py); null = the model config's router_aux_loss_coef, 0 = off (its
    # value is logged either way: train/router_aux_loss). torch and fsdp backends; megatron computes its
    # own definition of the loss (trainer/megatron/router_aux.py; logged only when the weight is > 0)
    router_aux_loss_coef: float | None = None
    # mixture-of-experts policies: route each scored token through the experts the engine used
    # (rollout routing replay, arXiv 2510.11370); every trainer backend, rollout/engine=vllm
    routing_replay: RoutingReplay = RoutingReplay.off
    megatron_vocab_multiple: int = 128  # megatron only: vocab padded to a multiple of this; tp must divide it
    batch_wait_timeout_s: float = 1800.0  # no trajectories for this long = rollout side is dead
    # fsdp only: compute in bfloat16 with float32 parameters and gradient reduction (model.dtype=float32)
    fsdp_mixed_precision: bool = False
    attention: Attention = Attention.varlen
    recompute: Recompute = Recompute.none
    # torch.compile each decoder layer (dynamic shapes; attention itself stays outside the graphs)
    compile: bool = False
    # cap on each rank's share of its GPU's memory (torch.cuda.set_per_process_memory_fraction) where
    # it shares the GPU with rollout servers; 0 = none. Set by the planner (gpu_shares.py)
    gpu_memory_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.backend is TrainerBackend.torch and self.tp_size * self.pp_size * self.dp_size != 1:
            raise ValueError("trainer.backend=torch runs one process: use trainer=megatron for TP/PP/DP")
        if self.backend is TrainerBackend.fsdp and self.tp_size * self.pp_size != 1:
            raise ValueError(
                "trainer.backend=fsdp shards over data-parallel ranks only: set trainer.tp_size=1 and "
                "trainer.pp_size=1 (or use trainer=megatron)"
            )
        self._check_expert_parallel()
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            raise ValueError(
                "trainer.router_aux_loss_coef must be >= 0 (0 = no load-balancing loss; null = the model's)"
            )
        if self.recompute is Recompute.selective and self.backend is not TrainerBackend.megatron:
            raise ValueError(
                f"trainer.recompute=selective recomputes Megatron's core attention and is implemented by "
                f"trainer=megatron only; on trainer.backend={self.backend.value} set trainer.recompute=full "
                "(recompute each decoder layer) or trainer.recompute=none"
            )
        if self.total_steps < 1:
            raise ValueError("trainer.total_steps must be >= 1")
        if not 0.0 <= self.gpu_memory_fraction <= 1.0:
            raise ValueError("trainer.gpu_memory_fraction must be in [0, 1] (0 = no cap)")
        if self.max_tokens_per_microbatch < 16:
            raise ValueError("trainer.max_tokens_per_microbatch must be >= 16")
        if self.logprob_chunk_tokens < 0:
            raise ValueError(
                "trainer.logprob_chunk_tokens must be >= 0 (tokens per LM-head chunk; 0 = no chunking)"
            )
        if self.logprob_chunk_tokens == 0 and self.logprob_kernel is LogprobKernel.triton:
            raise ValueError(
                "trainer.logprob_kernel=triton fuses the chunked head: set trainer.logprob_chunk_tokens > 0 "
                "(or trainer.logprob_kernel=auto/torch for the full-vocabulary path)"
            )
        if self.megatron_vocab_multiple % self.tp_size:  # megatron: padded vocab splits evenly over TP
            raise ValueError(
                f"trainer.megatron_vocab_multiple must be a multiple of trainer.tp_size={self.tp_size}"
            )

    def _check_expert_parallel(self) -> None:
        """EP and expert TP: Megatron's, positive, and folding onto TP x DP when DP is known (the
        planner derives DP and checks again; the model's expert count is checked with its shape,
        launch/planning/fit/memory_plan.py)."""
        if self.ep_size < 1 or self.expert_tp_size < 1:
            raise ValueError(
                "trainer.ep_size and trainer.expert_tp_size must be >= 1 (1 = no expert parallelism)"
            )
        if self.ep_size * self.expert_tp_size > 1 and self.backend is not TrainerBackend.megatron:
            raise ValueError(
                f"trainer.ep_size={self.ep_size} / trainer.expert_tp_size={self.expert_tp_size} are Megatron's "
                f"expert parallelism: use trainer=megatron, or set them to 1 on trainer.backend={self.backend.value}"
            )
        experts = self.ep_size * self.expert_tp_size
        if self.dp_size > 1 and (self.tp_size * self.dp_size) % experts:
            raise ValueError(
                f"trainer.ep_size={self.ep_size} x trainer.expert_tp_size={self.expert_tp_size} must divide "
                f"trainer.tp_size={self.tp_size} x trainer.dp_size={self.dp_size} (Megatron folds the expert "
                "grid onto the same ranks): change trainer.ep_size"
            )


@dataclass
class WeightSyncConfig:
    """How new weights reach the rollout servers after every step."""

    method: WeightSync = WeightSync.distributed
    backend: DistBackend = DistBackend.auto
    bucket_bytes: int = 1 << 30  # weights are sent in flattened buckets of at most this size
    master_port: int = 0  # 0 = pick a free port (local); set in cluster mode
    step_timeout_s: float = 120.0  # each handshake step (pause, group init, bucket, resume)
    sync: SyncMode = SyncMode.full  # full | delta (docs/weight-sync.md)
    # delta: a full copy (the anchor every delta chain starts from) at every version divisible by this
    full_every: int = 20

    def __post_init__(self) -> None:
        if self.full_every < 1:
            raise ValueError(
                "weight_sync.full_every must be >= 1 (a full copy every N versions; 1 = every update)"
            )
        if self.sync is SyncMode.delta and self.method is not WeightSync.distributed:
            raise ValueError(
                "weight_sync.sync=delta diffs what a broadcast carries: set weight_sync.method=distributed "
                "(or weight_sync.sync=full with the disk fallback)"
            )


@dataclass
class CheckpointConfig:
    """Periodic and on-signal checkpoints; resume from the newest one."""

    every_steps: int = 0  # 0 = only at the end and on SIGUSR1/SIGTERM
    keep_last: int = 2  # checkpoints kept in RUN_DIR/checkpoints (older ones are deleted)
    resume: bool = True  # resume from runs/<name>/checkpoints when present
