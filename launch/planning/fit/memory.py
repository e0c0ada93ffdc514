"""Trainer memory per rank, predicted from the model's shape and the resolved config. Pure: no torch.

    estimate = trainer_memory(shape, TrainerMemoryInputs.of(job, plan))
    estimate.total_bytes, estimate.parts        # what one trainer rank holds at its peak

Parts (docs/memory.md derives each term and the bench that checks it):
  parameters    the rank's share (Megatron: 1/(TP x PP); FSDP2: 1/DP; torch: all), in model.dtype
                (FSDP2 mixed precision: float32 master weights)
  gradients     Megatron: a float32 grad buffer over the rank's parameters (grad_reduce_in_fp32);
                FSDP2: sharded over DP in the parameters' dtype; torch: full, same dtype
  optimizer     Adam's two moments, plus Megatron's float32 main parameters for bf16 weights,
                sharded over DP by Megatron's distributed optimizer and by FSDP2; torch: full
  FSDP2 gather  the unsharded root (embeddings, head) and two decoder layers (one prefetched),
                in the compute dtype, with their unsharded gradients
  reference     a frozen copy of the parameters for algo.kl_coef > 0, sharded like the policy
  activations   per token, saved for backward by every layer (trainer.recompute=none), by the
                layers outside the core attention (selective, Megatron), or only each layer's
                input plus one recomputed layer (full); the whole micro-batch of T tokens
  log-probs     the LM head: trainer.logprob_chunk_tokens=0 keeps full-vocabulary float32 copies
                of the scored tokens' logits; a chunk of c tokens keeps ~2 [c, V] float32 copies
                and a float32 head-weight gradient
  attention     trainer.attention=dense: the [T, T] block mask and its per-layer copy that the
                kernel keeps for backward; varlen, varlen_attn, flex: none
  GPU only (GpuOverheads: parameters that bench/trainer/gpu_trainer.py measures and refits):
  kernel workspace  varlen_attn / flex backward: a float32 dq accumulator over the micro-batch
  compile workspace trainer.compile: inductor's buffers beyond the eager tensors (fit; 0 until measured)
  allocator reserve the caching allocator's reserved memory above its allocated peak (fit; 0 until
                measured: memory_plan.USABLE_SHARE's 5% of the GPU stands for it)
  runtime       CUDA context, communicator buffers (a constant), outside the caching allocator

Mixtures of experts (ModelShape.is_moe): Megatron splits each sparse layer's experts over EP x
expert TP ranks (trainer.ep_size, trainer.expert_tp_size) and the rest over TP as for a dense
model; the distributed optimizer shards the experts' state over the expert data-parallel group
(EDP = TP x DP / (expert TP x EP)), the rest over DP. FSDP2 and torch hold every expert (sharded
over DP / whole). Activations count the top-k experts each token goes through and the router.

Per-layer activation bytes come from what the layers' autograd saves (counted op by op in
docs/memory.md); the log-prob and mask terms from the code paths; the CPU bench
(`python -m bench --only trainer_memory`) measures peaks beside these predictions.

LoRA: `trainable_params` is the one function that says which parameters get gradients and Adam
state: with model.lora.rank > 0 the adapters' (LoraConfig.adapter_params), the frozen base stays
in `parameters`. (The adapters' own activations, r per token per target, are left out: small.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from areal_jobs.config import DType, JobConfig, LoraConfig, TrainerBackend
from areal_jobs.config.lora import decoder_projections
from launch.planning.fit.model_shape import ModelShape, padded_vocab

GIB = 1 << 30
RUNTIME_RESERVE_BYTES = int(1.5 * GIB)  # CUDA context (~0.5 GiB), NCCL/gloo buffers, cuBLAS workspace
_BYTES = {DType.float32: 4, DType.bfloat16: 2, DType.float16: 2}


@dataclass(frozen=True)
class GpuOverheads:
    """What a GPU adds to a trainer rank beyond the tensors the model counts. The defaults are
    estimates from the kernels' code, not yet measurements: bench/trainer/gpu_trainer.py prints measured /
    predicted per point (allocated, reserved, device) and the values these would take to fit
    (`fit_overheads`), for the session lent a GPU to write back here."""

    # outside torch's caching allocator: CUDA context (~0.5 GiB), NCCL buffers, library handles
    runtime_bytes: int = RUNTIME_RESERVE_BYTES
    # the caching allocator's reserved memory above its allocated peak, as a fraction of the
    # allocated peak (block rounding, segments split by earlier larger requests). 0 until measured:
    # memory_plan.USABLE_SHARE plans for 95% of the GPU, which covers 5%
    reserve_fraction: float = 0.0
    # trainer.compile: inductor's own buffers (generated kernels' workspaces) at the peak; 0 until measured
    compile_workspace_bytes: int = 0
    # varlen_attn (FlashAttention-2) and flex backward: bytes per query element of the micro-batch
    # (T x heads x head_dim): FlashAttention-2's float32 dq accumulator (flex's: assumed alike)
    attention_workspace_bytes_per_query_elem: int = 4


DEFAULT_GPU_OVERHEADS = GpuOverheads()


@dataclass(frozen=True)
class TrainerMemoryInputs:
    """Everything of the job and its plan that sizes one trainer rank."""

    backend: TrainerBackend
    param_bytes: int  # bytes per parameter (model.dtype; FSDP2 mixed precision: 4)
    compute_bytes: int  # bytes per activation element (FSDP2 mixed precision: 2)
    tp: int
    pp: int
    dp: int
    tokens: int  # trainer.max_tokens_per_microbatch: one packed micro-batch
    scored_tokens: int  # output positions of the micro-batch that go through the LM head (<= tokens)
    recompute: str  # none | selective | full
    attention: str  # varlen | dense | varlen_attn | flex
    logprob_chunk_tokens: int  # 0 = the whole micro-batch's scored tokens at once
    reference_model: bool = False  # algo.kl_coef > 0
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)  # model.lora: rank > 0 trains adapters
    vocab_multiple: int = 1  # Megatron pads the vocabulary to a multiple of this
    on_gpu: bool = True  # the runtime reserve exists on a GPU only
    # trainer.logprob_kernel as run: "triton" (one [chunk, V] buffer in the compute dtype) or
    # "torch"; `of` plans `auto` as torch, the larger, until a GPU measurement confirms the kernel's
    logprob_kernel: str = "torch"
    compile: bool = False  # trainer.compile
    # the attention kernel copies K and V to every query head, and keeps the copies for backward
    # (dense always; varlen_attn on torch < 2.12, which has no GQA flag)
    kv_repeat: bool = False
    overheads: GpuOverheads = DEFAULT_GPU_OVERHEADS
    ep: int = 1  # Megatron expert parallelism (trainer.ep_size)
    etp: int = 1  # Megatron expert tensor parallelism (trainer.expert_tp_size)

    @property
    def edp(self) -> int:
        """Megatron's expert data-parallel size: the ranks of a stage (TP x DP) over the expert grid."""
        return max(1, self.tp * self.dp // (self.ep * self.etp))

    @classmethod
    def of(cls, job: JobConfig, *, tp: int, pp: int, dp: int, on_gpu: bool = True) -> TrainerMemoryInputs:
        """From a resolved job and its plan's layout. The scored tokens are taken as the whole
        micro-batch (prompt tokens are a small share of RL sequences): the worst case."""
        t = job.trainer
        mixed = t.backend is TrainerBackend.fsdp and t.fsdp_mixed_precision
        dtype_bytes = _BYTES[job.model.dtype]
        return cls(
            backend=t.backend,
            param_bytes=4 if mixed else dtype_bytes,
            compute_bytes=2 if mixed else dtype_bytes,
            tp=tp,
            pp=pp,
            dp=dp,
            tokens=t.max_tokens_per_microbatch,
            scored_tokens=t.max_tokens_per_microbatch,
            recompute=t.recompute.value,
            attention=t.attention.value,
            logprob_chunk_tokens=t.logprob_chunk_tokens,
            reference_model=job.algo.kl_coef > 0,
            lora=job.model.lora,
            vocab_multiple=t.megatron_vocab_multiple if t.backend is TrainerBackend.megatron else 1,
            on_gpu=on_gpu,
            logprob_kernel="triton" if t.logprob_kernel.value == "triton" else "torch",
            compile=t.compile,
            ep=t.ep_size,
            etp=t.expert_tp_size,
        )

    def but(self, **changes) -> TrainerMemoryInputs:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class MemoryEstimate:
    """One trainer rank's predicted peak, part by part: (name, bytes, how it was counted)."""

    parts: tuple[tuple[str, int, str], ...]

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b, _ in self.parts)

    @property
    def allocated_bytes(self) -> int:
        """What torch's caching allocator hands out at the peak (torch.cuda.max_memory_allocated)."""
        return self.total_bytes - self.part("runtime") - self.part("allocator reserve")

    @property
    def reserved_bytes(self) -> int:
        """What the caching allocator holds from the device at the peak (max_memory_reserved)."""
        return self.total_bytes - self.part("runtime")

    def part(self, name: str) -> int:
        return sum(b for n, b, _ in self.parts if n == name)


def trainer_memory(shape: ModelShape, x: TrainerMemoryInputs) -> MemoryEstimate:
    """The peak of one trainer rank (the first pipeline stage's activations, the last stage's head)."""
    dense, experts = rank_param_groups(shape, x)
    params = dense + experts
    trainable = trainable_params(shape, x, params)
    shards = x.dp if x.backend is TrainerBackend.fsdp else 1
    how = f"{params / 1e9:.3g}B params x {x.param_bytes} B" + (f" / DP {shards}" if shards > 1 else "")
    if experts and x.backend is TrainerBackend.megatron:
        split = f"EP {x.ep}" + (f" x expert TP {x.etp}" if x.etp > 1 else "")
        how = f"{dense / 1e9:.3g}B dense + {experts / 1e9:.3g}B expert ({split}) params x {x.param_bytes} B"
    parts = [
        # the adapters are parameters too (beside the frozen base), in the same dtype
        ("parameters", (params + (trainable if x.lora.enabled else 0)) * x.param_bytes // shards, how),
        _gradients(trainable, x),
        _optimizer(trainable, x, 0 if x.lora.enabled else experts),
    ]
    if x.backend is TrainerBackend.fsdp:
        parts.append(_fsdp_gather(shape, x))
    if x.reference_model:
        frozen = params * x.param_bytes // shards
        parts.append(("reference model", frozen, "frozen copy for algo.kl_coef > 0, sharded alike"))
    parts += [_activations(shape, x), _logprobs(shape, x), _attention(shape, x)]
    if x.on_gpu:
        parts += _gpu_parts(shape, x, sum(b for _, b, _ in parts))
    return MemoryEstimate(tuple(parts))


def _gpu_parts(shape: ModelShape, x: TrainerMemoryInputs, tensors: int) -> list[tuple[str, int, str]]:
    """The GPU's additions (GpuOverheads); a part whose parameter is 0 is left out of the list."""
    o = x.overheads
    parts = []
    if x.attention in ("varlen_attn", "flex"):
        q = shape.num_heads * shape.head_dim // x.tp
        size = x.tokens * q * o.attention_workspace_bytes_per_query_elem
        parts.append(
            ("kernel workspace", size, f"{x.attention} backward: dq accumulator, {x.tokens:,} x {q}")
        )
    if x.compile and o.compile_workspace_bytes:
        parts.append(("compile workspace", o.compile_workspace_bytes, "trainer.compile: inductor buffers"))
    if o.reserve_fraction:
        allocated = tensors + sum(b for _, b, _ in parts)
        parts.append(
            (
                "allocator reserve",
                int(allocated * o.reserve_fraction),
                f"{o.reserve_fraction:.1%} of allocated",
            )
        )
    parts.append(("runtime", o.runtime_bytes, "CUDA context, communicators, workspaces"))
    return parts


def rank_params(shape: ModelShape, x: TrainerMemoryInputs) -> int:
    """Parameters one rank holds: Megatron's largest pipeline stage split over TP (experts over
    EP x expert TP); FSDP2 and torch: the whole model (FSDP2's 1/DP shard is applied per part)."""
    return sum(rank_param_groups(shape, x))


def rank_param_groups(shape: ModelShape, x: TrainerMemoryInputs) -> tuple[int, int]:
    """(dense, expert) parameters of one rank: the routed experts apart, because Megatron splits
    them over EP x expert TP and shards their optimizer state over the expert data-parallel group.
    FSDP2 and torch: (every other parameter, every expert) of the whole model."""
    if x.backend is not TrainerBackend.megatron:
        experts = shape.expert_params()
        return shape.num_params() - experts, experts
    embedding = shape.embedding_params(x.vocab_multiple)
    stage = -(-shape.num_layers // x.pp)
    # the largest stage: as many sparse layers as it can hold (a dense model: none)
    sparse = min(stage, shape.moe_layers) if shape.is_moe else 0
    split = (stage - sparse) * shape.dense_layer_params + sparse * (
        shape.attention_params + shape.shared_expert_params
    )
    router = sparse * shape.router_params  # Megatron's router weight is whole on every TP rank
    experts = sparse * shape.expert_params_per_layer // (x.ep * x.etp)
    if x.pp == 1:
        heads = embedding * (1 if shape.tied_embeddings else 2)
        return (heads + split) // x.tp + router + shape.hidden_size, experts
    # the first stage holds the embedding, the last the output layer (a copy of it when tied)
    return (embedding + split) // x.tp + router + shape.hidden_size, experts


def trainable_params(shape: ModelShape, x: TrainerMemoryInputs, params: int) -> int:
    """Parameters with gradients and optimiser state: all of them (full fine-tuning), or with
    model.lora.rank > 0 the adapters only (the frozen base stays in `parameters`), in the base's
    dtype as trainer/forward/lora.py attaches them."""
    if not x.lora.enabled:
        return params
    projections = decoder_projections(
        shape.hidden_size, shape.intermediate_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
    )
    return x.lora.adapter_params(shape.num_layers, projections)


def _gradients(trainable: int, x: TrainerMemoryInputs) -> tuple[str, int, str]:
    if x.backend is TrainerBackend.megatron:
        return ("gradients", trainable * 4, "float32 grad buffer (grad_reduce_in_fp32)")
    if x.backend is TrainerBackend.fsdp:
        return ("gradients", trainable * x.param_bytes // x.dp, f"sharded over DP {x.dp}")
    return ("gradients", trainable * x.param_bytes, "one per parameter")


def _optimizer(trainable: int, x: TrainerMemoryInputs, experts: int = 0) -> tuple[str, int, str]:
    """`experts`: the rank's expert parameters among `trainable` (Megatron shards their state over
    the expert data-parallel group instead of DP)."""
    if x.backend is TrainerBackend.megatron:
        # distributed optimizer: Adam m, v in float32 (+ float32 main params for bf16 weights)
        per_param = 8 + (4 if x.param_bytes < 4 else 0)
        how = f"Adam {per_param} B/param sharded over DP {x.dp} (distributed optimizer)"
        if experts:
            how += f", the experts' over expert DP {x.edp}"
        size = (trainable - experts) * per_param // x.dp + experts * per_param // x.edp
        return ("optimizer", size, how)
    moments = 2 * x.param_bytes  # torch AdamW keeps m, v in the parameters' dtype
    if x.backend is TrainerBackend.fsdp:
        return ("optimizer", trainable * moments // x.dp, f"AdamW m, v sharded over DP {x.dp}")
    return ("optimizer", trainable * moments, "AdamW m, v")


def _fsdp_gather(shape: ModelShape, x: TrainerMemoryInputs) -> tuple[str, int, str]:
    """FSDP2 all-gathers a unit's parameters for its forward and backward (and its unsharded
    gradients before the reduce-scatter): the root (embeddings + head) the whole time, two
    decoder layers at once (the current one and the prefetched next)."""
    if x.dp == 1:
        return ("FSDP2 gather", 0, "one rank: nothing to gather")
    root = shape.embedding_params() * (1 if shape.tied_embeddings else 2)
    unsharded = (root + 2 * shape.layer_params) * x.compute_bytes
    return ("FSDP2 gather", 2 * unsharded, "root + 2 layers unsharded, params and grads")


def layer_activation_bytes(shape: ModelShape, x: TrainerMemoryInputs) -> dict[str, float]:
    """Bytes per token one decoder layer saves for backward with recompute=none, split into the
    core attention's own (its output and float32 log-sum-exp, which selective recompute drops)
    and the rest. Counted from each backend's autograd graph (docs/memory.md): H hidden, F
    intermediate, q / kv the query / key-value widths (heads x head_dim), e compute bytes; TP
    splits everything but the hidden-size tensors."""
    h, f, e, tp = shape.hidden_size, shape.intermediate_size, x.compute_bytes, x.tp
    q, kv = shape.num_heads * shape.head_dim / tp, shape.num_kv_heads * shape.head_dim / tp
    core = e * q + 4 * shape.num_heads / tp
    mlp = moe_mlp_activation_bytes(shape, x) if shape.is_moe else None
    if x.backend is TrainerBackend.megatron:
        # two RMSNorms (input, normalised, output: 3H each), the fused qkv buffer (kept by the v
        # view), the roped q and k and the cos/sin each RoPE multiplication keeps (4 x head_dim),
        # the projection's input, fc1's output (2F, kept by the GLU's chunk views), silu(gate),
        # the GLU's `x_linear + glu_linear_offset` (a copy even at offset 0) and the fc2 input
        rope = 4 * shape.head_dim
        rest = e * (6 * h + (q + 2 * kv) + (q + kv) + rope + q) + 8
        rest += e * 5 * f / tp if mlp is None else mlp
        if x.kv_repeat:  # the repeated K and V the kernel keeps, beside the THD originals
            rest += e * 2 * q
    else:
        # two HF RMSNorms: float32 input, normalised and output (12H in float32; 16H per layer in
        # bf16: a float32 copy and two bf16 tensors each); roped q and k and v (dense: k and v
        # repeated to every query head by transformers' sdpa path), o_proj's input, and the MLP's
        # gate, silu(gate), up and product
        norms = 24 * h if e == 4 else 16 * h
        keys = 2 * q if x.attention == "dense" or x.kv_repeat else 2 * kv
        rest = norms + e * (q + keys + q) + (e * 4 * f if mlp is None else mlp)
    return {"core": core, "rest": rest}


def moe_mlp_activation_bytes(shape: ModelShape, x: TrainerMemoryInputs) -> float:
    """Bytes per token a sparse layer's MLP saves for backward (replacing the dense MLP's), with
    the routing balanced (each rank's experts get k copies of each of its tokens on average): k
    experts' SwiGLU intermediates of width Fm, the k routed copies of the token going in and
    coming out (the unpermute keeps them for the routing weights' gradient), the router's float32
    logits and probabilities over the E experts, and a shared expert's dense MLP.
      Megatron (grouped GEMM, alltoall dispatcher): e (5 k Fm / ETP + 2 k H) + 8 E (+ 5 Fs / TP)
      HF (per-expert loop): e (4 k Fm + 2 k H) + (e + 4) E (+ 4 Fs)"""
    h, e, k, experts = shape.hidden_size, x.compute_bytes, shape.experts_per_token, shape.num_experts
    fm, fs = shape.moe_intermediate_size, shape.shared_expert_intermediate_size
    if x.backend is TrainerBackend.megatron:
        return e * (5 * k * fm / x.etp + 2 * k * h + 5 * fs / x.tp) + 8 * experts
    return e * (4 * k * fm + 2 * k * h + 4 * fs) + (e + 4) * experts


def final_norm_bytes(shape: ModelShape, x: TrainerMemoryInputs) -> int:
    """Per token, the final RMSNorm's saved tensors (its output feeds the LM head); HF models
    also keep one cos/sin pair for every layer's RoPE."""
    if x.backend is TrainerBackend.megatron:
        return 3 * shape.hidden_size * x.compute_bytes
    return shape.hidden_size * (12 if x.compute_bytes == 4 else 8) + 2 * shape.head_dim * x.compute_bytes


def _activations(shape: ModelShape, x: TrainerMemoryInputs) -> tuple[str, int, str]:
    per_layer = layer_activation_bytes(shape, x)
    full_layer = per_layer["core"] + per_layer["rest"]
    # 1F1B: the first stage holds PP micro-batches in flight, each of L/PP layers: L layers' worth
    layers = -(-shape.num_layers // x.pp) * x.pp
    tail = final_norm_bytes(shape, x)
    if x.recompute == "none":
        per_token = layers * full_layer + tail
        how = f"{layers} layers x {full_layer / 1024:.1f} KiB/token"
    elif x.recompute == "selective":
        per_token = layers * per_layer["rest"] + per_layer["core"] + tail
        how = f"{layers} layers x {per_layer['rest'] / 1024:.1f} KiB/token (core attention recomputed)"
    else:
        per_token = layers * shape.hidden_size * x.compute_bytes + full_layer + tail
        how = f"{layers} layer inputs + 1 recomputed layer ({full_layer / 1024:.1f} KiB/token)"
    return ("activations", int(per_token * x.tokens), f"{how}, {x.tokens:,} tokens")


def _logprobs(shape: ModelShape, x: TrainerMemoryInputs) -> tuple[str, int, str]:
    vocab = padded_vocab(shape.vocab_size, x.vocab_multiple) // x.tp
    n, e = x.scored_tokens, x.compute_bytes
    rows = n * shape.hidden_size * e  # the scored positions' hidden states, gathered for the head
    if x.logprob_chunk_tokens == 0:
        if x.backend is TrainerBackend.megatron:
            # every position's float32 logits (vocab_parallel_cross_entropy keeps its softmax in
            # them) and the entropy's float32 temporaries over the scored rows
            copies = x.tokens + FULL_VOCAB_ENTROPY_COPIES * n
        else:
            copies = FULL_VOCAB_COPIES * n
        how = f"full vocabulary: [T, {vocab:,}] float32 x {copies / x.tokens:.1f}"
        return ("log-probs", int(copies * vocab * 4) + rows, how)
    chunk = min(x.logprob_chunk_tokens, n)
    # the weight gradient accumulates in float32 (+ a bf16 product per chunk for bf16 weights)
    head_grad = vocab * shape.hidden_size * (4 + (2 if e == 2 else 0))
    if x.logprob_kernel == "triton":
        # the Triton kernels read the matmul's logits in the compute dtype and write the gradient
        # over them (trainer/forward/logprob_kernels.py): one [chunk, V] buffer
        size = chunk * vocab * e + head_grad + rows
        return ("log-probs", size, f"chunks of {chunk:,} tokens: [{chunk:,}, {vocab:,}] x {e} B (Triton)")
    size = int(CHUNK_COPIES * chunk * vocab * 4) + head_grad + rows
    return (
        "log-probs",
        size,
        f"chunks of {chunk:,} tokens: [{chunk:,}, {vocab:,}] float32 x {CHUNK_COPIES:g}",
    )


def _attention(shape: ModelShape, x: TrainerMemoryInputs) -> tuple[str, int, str]:
    if x.attention == "varlen":
        return ("attention", 0, "varlen: per-sequence kernels, no [T, T] tensor")
    if x.attention in ("varlen_attn", "flex"):
        return ("attention", 0, f"{x.attention}: one kernel from cu_seqlens, no [T, T] tensor")
    layers = -(-shape.num_layers // x.pp) * x.pp
    # the bool block mask, and per layer the additive mask SDPA converts it to (compute dtype),
    # which the fused kernel keeps for its backward
    size = x.tokens * x.tokens * (1 + layers * x.compute_bytes)
    return ("attention", int(size), f"dense: [T, T] mask + {layers} per-layer copies")


# float32 [rows, V] copies alive at the peak of each log-prob path (trainer/forward/logprobs.py,
# megatron/head.py), checked by the CPU bench (bench/README.md "trainer_memory")
# torch/FSDP2: every position's logits, each sample's saved log-softmax, the entropy's exp and
# exp*logp of one sample, and in backward the slices' gradients accumulated into [T, V]: between 3.1
# and 3.7 [N, V] at the peak (CPU bench, 2 and 4 sequences of 1,024 tokens); 3.4 is both to 8%
FULL_VOCAB_COPIES = 3.4
FULL_VOCAB_ENTROPY_COPIES = 5.25  # index_select, shifted, exp, masked, product + bool (Megatron)
CHUNK_COPIES = 2.0  # a chunk's logits and exp (forward) / log-probs and probabilities (backward)
