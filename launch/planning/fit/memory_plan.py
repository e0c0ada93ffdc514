"""Does the planned job fit its GPUs? The trainer's memory per rank and the servers' KV cache.

    report = check_memory(job, plan)        # raises ValueError naming overrides that would fit
    print(report.describe())                # the block `make render` / `make submit` print

The trainer must fit `cluster.gpu_memory_gib` (times USABLE_SHARE: the caching allocator's
fragmentation) by the model of launch/planning/fit/memory.py; if it does not, the refusal lists the
single overrides that make it fit by the same model (a smaller `trainer.max_tokens_per_microbatch`
that still holds the longest sequence, `trainer.recompute`, a chunked `trainer.logprob_chunk_tokens`,
`trainer.attention=varlen`, a larger `trainer.tp_size` / `trainer.pp_size` / `trainer.ep_size`),
and, when the caller passes the job before planning (`check_memory(..., unplanned=job)`, as
`make submit` does), the layouts (cluster.rollout_fraction / placement / nodes, searched by
launch/planning/layout/suggest.py) whose trainer ranks fit. The rollout side
(launch/planning/fit/kv_cache.py) is reported, not refused: a KV cache that holds fewer requests than
`rollout.max_concurrent` spreads over the servers makes the plan's throughput optimistic, and the
block says how many it holds.

Colocated placement shares every GPU between a server and a trainer rank: the KV-cache report then
gives the server what the trainer leaves (`memory_shares`; nothing calls it: the shares the
processes are launched with are gpu_shares.py's even split, docs/small-clusters.md). A model whose shape is unknown (no config.json at model.path and no
`model.shape`) is not checked; the block says so and names `model.shape`.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_jobs.config import JobConfig, Placement, TrainerBackend
from launch.planning.fit.kv_cache import KvCachePlan, kv_cache_plan
from launch.planning.fit.memory import GIB, MemoryEstimate, TrainerMemoryInputs, trainer_memory
from launch.planning.fit.model_shape import NAMED_SHAPES, ModelShape, resolve_shape
from launch.planning.layout.plan import AllocationPlan, apply_plan
from launch.planning.layout.suggest import layout_fixes

USABLE_SHARE = 0.95  # the share of a GPU the trainer may plan for: allocator fragmentation and slack
TOKEN_STEP = 1024  # suggested micro-batch budgets are multiples of this


@dataclass(frozen=True)
class MemoryShares:
    """What one GPU's memory is split into: the trainer rank's predicted bytes and the rollout
    server's static share (SGLang --mem-fraction-static / vLLM --gpu-memory-utilization)."""

    gpu_bytes: int
    trainer_bytes_per_rank: int
    server_fraction: float  # of the whole GPU, for weights + KV cache (+ vLLM's activations)
    shared_gpu: bool  # colocated: one GPU holds both


@dataclass(frozen=True)
class Layout:
    """What of the allocation plan sizes memory (launch.local has no AllocationPlan: `local_layout`)."""

    tp: int
    pp: int
    dp: int
    num_servers: int
    trainer_gpus: int
    gpus_per_node: int
    shared_gpu: bool  # colocated: a server and a trainer rank on every GPU

    @classmethod
    def of(cls, job: JobConfig, plan: AllocationPlan) -> Layout:
        return cls(
            plan.trainer_tp,
            plan.trainer_pp,
            plan.trainer_dp,
            plan.num_servers,
            plan.trainer_gpus,
            job.cluster.gpus_per_node,
            plan.placement is Placement.colocated,
        )


def local_layout(job: JobConfig) -> Layout:
    """`make run` on a machine with GPUs: the trainer ranks and the servers share its GPUs."""
    t = job.trainer
    return Layout(t.tp_size, t.pp_size, t.dp_size, job.rollout.num_servers, t.tp_size * t.pp_size * t.dp_size,
                  job.cluster.gpus_per_node, True)  # fmt: skip


@dataclass(frozen=True)
class MemoryPlan:
    shape: ModelShape
    inputs: TrainerMemoryInputs
    trainer: MemoryEstimate
    kv: KvCachePlan
    shares: MemoryShares

    @property
    def trainer_budget_bytes(self) -> int:
        usable = int(self.shares.gpu_bytes * USABLE_SHARE)
        if self.shares.shared_gpu:  # the colocated server's weights stay on the GPU throughout
            return usable - self.kv.weights_bytes_per_gpu
        return usable

    @property
    def trainer_fits(self) -> bool:
        return self.trainer.total_bytes <= self.trainer_budget_bytes

    def describe(self) -> str:
        x = self.inputs
        layout = (
            f"TP {x.tp} x PP {x.pp} x DP {x.dp}" if x.backend is TrainerBackend.megatron else f"DP {x.dp}"
        )
        if x.backend is TrainerBackend.megatron and x.ep * x.etp > 1:
            layout += f", EP {x.ep}" + (f" x expert TP {x.etp}" if x.etp > 1 else "") + f", expert DP {x.edp}"
        model = self.shape.source
        if self.shape.is_moe:
            s = self.shape
            model += (
                f" ({s.num_params() / 1e9:.3g}B params, {s.active_params() / 1e9:.3g}B active: "
                f"{s.num_experts} experts, top-{s.experts_per_token})"
            )
        knobs = (
            f"{x.tokens:,} tokens/micro-batch, recompute={x.recompute}, attention={x.attention}, "
            f"logprob_chunk_tokens={x.logprob_chunk_tokens}"
        )
        head = (
            f"trainer memory per rank ({x.backend.value} {layout}, {model}; {knobs}): "
            f"{self.trainer.total_bytes / GIB:.1f} GiB of {self.trainer_budget_bytes / GIB:.1f} GiB usable "
            f"({self.shares.gpu_bytes / GIB:.0f} GiB GPU x {USABLE_SHARE:g}"
            + (", less the colocated server's weights" if self.shares.shared_gpu else "")
            + ")"
            + ("" if self.trainer_fits else ": DOES NOT FIT")
        )
        rows = [f"  {name:<13} {size / GIB:7.2f} GiB  {how}" for name, size, how in self.trainer.parts]
        return "\n".join([head, *rows, self.kv.describe()])


def memory_plan(job: JobConfig, plan: AllocationPlan | Layout) -> MemoryPlan | None:
    """The memory plan of a planned job (apply_plan's output), or None when the shape is unknown."""
    shape = resolve_shape(job)
    if shape is None:
        return None
    check_experts(job, shape)
    layout = plan if isinstance(plan, Layout) else Layout.of(job, plan)
    inputs = TrainerMemoryInputs.of(job, tp=layout.tp, pp=layout.pp, dp=layout.dp)
    return _plan_for(job, layout, shape, inputs)


def _plan_for(job: JobConfig, layout: Layout, shape: ModelShape, inputs: TrainerMemoryInputs) -> MemoryPlan:
    estimate = trainer_memory(shape, inputs)
    gpu_bytes = int(job.cluster.gpu_memory_gib * GIB)
    fraction = None
    if layout.shared_gpu:  # the server gets what the trainer rank leaves of the usable memory
        fraction = max(0.0, (gpu_bytes * USABLE_SHARE - estimate.total_bytes) / gpu_bytes)
    kv = kv_cache_plan(job, shape, layout.num_servers, static_fraction=fraction)
    shares = MemoryShares(gpu_bytes, estimate.total_bytes, kv.static_fraction, layout.shared_gpu)
    return MemoryPlan(shape, inputs, estimate, kv, shares)


def check_experts(job: JobConfig, shape: ModelShape) -> None:
    """Megatron's expert parallelism against the model: EP must divide the experts (each rank gets
    whole experts), expert TP each expert's width; EP > 1 needs a mixture of experts. And an MoE
    on Megatron trains at TP 1: megatron-core's MoE layer needs sequence parallelism with TP > 1,
    which the trainer does not run (trainer/megatron/convert.py check_layout refuses it at setup;
    here the job is refused before it is submitted)."""
    t = job.trainer
    if shape.is_moe and t.backend is TrainerBackend.megatron and t.tp_size > 1:
        raise ValueError(
            f"trainer.tp_size={t.tp_size}: a mixture of experts ({shape.source}) trains on Megatron at "
            "trainer.tp_size=1 (megatron-core's MoE layer needs sequence parallelism with TP > 1, "
            "which the trainer does not run); split it with trainer.ep_size, trainer.pp_size and "
            "trainer.dp_size"
        )
    if t.ep_size == 1 and t.expert_tp_size == 1:
        return
    if not shape.is_moe:
        raise ValueError(
            f"trainer.ep_size={t.ep_size} / trainer.expert_tp_size={t.expert_tp_size} split experts, but "
            f"{shape.source} is a dense model: set trainer.ep_size=1 trainer.expert_tp_size=1"
        )
    if shape.num_experts % t.ep_size:
        choices = [d for d in range(1, shape.num_experts + 1) if shape.num_experts % d == 0]
        raise ValueError(
            f"trainer.ep_size={t.ep_size} must divide the model's {shape.num_experts} experts ({shape.source}): "
            f"use trainer.ep_size in {choices}"
        )
    if shape.moe_intermediate_size % t.expert_tp_size:
        raise ValueError(
            f"trainer.expert_tp_size={t.expert_tp_size} must divide the experts' width "
            f"{shape.moe_intermediate_size} ({shape.source}): change trainer.expert_tp_size"
        )


def memory_shares(job: JobConfig, plan: AllocationPlan | Layout) -> MemoryShares | None:
    """For the launcher that divides a GPU between processes (issue 28): the trainer rank's
    predicted bytes and the servers' static memory share (None: the model's shape is unknown)."""
    report = memory_plan(job, plan)
    return None if report is None else report.shares


def check_memory(
    job: JobConfig, plan: AllocationPlan | Layout, *, unplanned: JobConfig | None = None
) -> MemoryPlan | None:
    """The memory plan; ValueError naming overrides that fit when a trainer rank does not fit.
    `unplanned`: the job before apply_plan, to also search the layouts whose trainer fits (slow:
    each candidate is planned; the caller that prints the refusal passes it)."""
    report = memory_plan(job, plan)
    if report is None or report.trainer_fits:
        return report
    layout = plan if isinstance(plan, Layout) else Layout.of(job, plan)
    options = fitting_overrides(job, layout, report)
    if unplanned is not None:
        options += fitting_layouts(unplanned)
    need = report.trainer.total_bytes / GIB
    have = report.trainer_budget_bytes / GIB
    largest = max(report.trainer.parts, key=lambda p: p[1])
    fix = (
        "fits with " + " or ".join(options)
        if options
        else "no single override fits: combine them, or use more trainer GPUs (cluster.nodes)"
    )
    raise ValueError(
        f"a trainer rank needs {need:.1f} GiB but cluster.gpu_memory_gib={job.cluster.gpu_memory_gib:g} leaves "
        f"{have:.1f} GiB usable (largest part: {largest[0]} {largest[1] / GIB:.1f} GiB, {largest[2]}): {fix}\n"
        + report.describe()
    )


def longest_sequence(job: JobConfig) -> int:
    """The longest sequence the trainer may get: a micro-batch must hold it whole."""
    wf = job.rollout.workflow
    answer = job.rollout.max_new_tokens
    if wf.name != "single_turn":
        answer = wf.max_episode_tokens or wf.max_turns * (answer + wf.tool_output_chars)
    return job.data.max_prompt_tokens + answer


def fitting_overrides(job: JobConfig, layout: Layout, report: MemoryPlan) -> list[str]:
    """Single overrides that make a trainer rank fit, each checked by the same model."""
    x, shape = report.inputs, report.shape

    def fits(inputs: TrainerMemoryInputs) -> bool:
        return _plan_for(job, layout, shape, inputs).trainer_fits

    found: list[str] = []
    longest = longest_sequence(job)
    tokens = (x.tokens - 1) // TOKEN_STEP * TOKEN_STEP
    while tokens >= max(longest, TOKEN_STEP):
        if fits(x.but(tokens=tokens, scored_tokens=min(x.scored_tokens, tokens))):
            found.append(f"trainer.max_tokens_per_microbatch={tokens}")
            break
        tokens -= TOKEN_STEP
    modes = ["selective", "full"] if x.backend is TrainerBackend.megatron else ["full"]
    for mode in modes[modes.index(x.recompute) + 1 :] if x.recompute in modes else modes:
        if fits(x.but(recompute=mode)):
            found.append(f"trainer.recompute={mode}")
            break
    if x.attention == "dense" and fits(x.but(attention="varlen")):
        found.append("trainer.attention=varlen")
    if x.logprob_chunk_tokens == 0 or x.logprob_chunk_tokens > 1024:
        if fits(x.but(logprob_chunk_tokens=1024)):
            found.append("trainer.logprob_chunk_tokens=1024")
    if x.backend is TrainerBackend.megatron:
        found += _model_parallel_options(layout, shape, x, fits)
        found += _expert_parallel_options(shape, x, fits)
    return found


def _expert_parallel_options(shape: ModelShape, x: TrainerMemoryInputs, fits) -> list[str]:
    """The smallest larger EP that divides the experts and folds onto TP x DP, and fits."""
    if not shape.is_moe:
        return []
    for ep in range(x.ep + 1, shape.num_experts + 1):
        if shape.num_experts % ep or (x.tp * x.dp) % (ep * x.etp):
            continue
        if fits(x.but(ep=ep)):
            return [f"trainer.ep_size={ep}"]
    return []


def fitting_layouts(unplanned: JobConfig) -> list[str]:
    """Other splits of the nodes (launch/planning/layout/suggest.py's candidates) whose plan the planner
    accepts and whose trainer rank fits: e.g. more trainer nodes, which shard the optimizer over
    more ranks. Each as its overrides and plan, as the layout refusals print them."""
    shape = resolve_shape(unplanned)

    def trainer_fits(candidate: JobConfig, plan: AllocationPlan) -> bool:
        """The trainer side only (the KV cache is reported, not refused): no profile to load."""
        layout = Layout.of(candidate, plan)
        planned = apply_plan(candidate, plan)
        inputs = TrainerMemoryInputs.of(planned, tp=layout.tp, pp=layout.pp, dp=layout.dp)
        if layout.shared_gpu:  # the server's weights share the GPU: the whole plan decides
            return _plan_for(planned, layout, shape, inputs).trainer_fits
        usable = int(planned.cluster.gpu_memory_gib * GIB * USABLE_SHARE)
        return trainer_memory(shape, inputs).total_bytes <= usable

    if shape is None:
        return []
    fixes = layout_fixes(unplanned, accept=trainer_fits)
    return [" ".join(f.overrides) + f" ({f.plan.describe()})" for f in fixes[:1]]


def _model_parallel_options(layout: Layout, shape: ModelShape, x: TrainerMemoryInputs, fits) -> list[str]:
    """The smallest larger TP (within a node, dividing the heads) and PP that fit."""
    gpus, per_node = layout.trainer_gpus, layout.gpus_per_node
    out = []
    for tp in (2 * x.tp, 4 * x.tp, 8 * x.tp):
        if tp > per_node or per_node % tp or gpus % (tp * x.pp):
            continue
        if shape.num_heads % tp or shape.num_kv_heads % tp:
            continue
        if fits(x.but(tp=tp, dp=gpus // (tp * x.pp))):
            out.append(f"trainer.tp_size={tp}")
            break
    for pp in (2 * x.pp, 4 * x.pp, 8 * x.pp):
        if gpus % (x.tp * pp) or shape.num_layers % pp:
            continue
        if fits(x.but(pp=pp, dp=gpus // (x.tp * pp))):
            out.append(f"trainer.pp_size={pp}")
            break
    return out


def unknown_shape_note(job: JobConfig) -> str:
    where = job.model.path or job.model.builtin_dir
    return (
        f"memory: not checked: no config.json at model.path={where} and no model.shape; set "
        f"model.shape to one of {sorted(NAMED_SHAPES)} (or point model.path at the model) to check it"
    )
