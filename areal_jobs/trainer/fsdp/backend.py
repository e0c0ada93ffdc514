"""PyTorch FSDP2 trainer backend: a Hugging Face causal LM sharded with `fully_shard`, DP ranks.

No conversion: the model is the transformers class the torch backend trains, each decoder layer
and then the root wrapped by `fully_shard` over all trainer ranks (one per GPU; gloo on CPU).
One `train_step`, on every rank at once:
  1. rank 0's TrainBatch is broadcast; every rank derives the same plan (trainer/intake/dp_plan.py):
     token-balanced DP shares, packed micro-batches, the same count on every rank (padded with
     empty ones, which run a one-token forward so the FSDP collectives stay in step);
  2. proximal log-probs of this rank's samples with the pre-step weights (forward only), except
     with algo.prox_logp=current (the default) for the first minibatch, whose gradient pass
     runs those weights and supplies them (with one minibatch: no proximal pass at all); with
     algo.kl_coef > 0 the reference log-probs of this rank's samples, from a frozen copy of the
     initial weights sharded like the policy (fully_shard, no optimiser), once per batch;
  3. the torch backend's schedule: `algo.ppo_minibatches` token-balanced minibatches, each split
     over the DP ranks, the project's `ppo_loss` normalised by the minibatch's output
     tokens, clipping at `trainer.grad_clip` and one AdamW step. FSDP averages gradients over
     ranks; the loss is already a global token-mean, so each rank scales it by the world size
     (exact for powers of two) and the reduced gradient is the sum, as in one process.
Packing, log-probs, `trainer.attention`, `trainer.logprob_kernel`, `trainer.compile` and
`trainer.recompute=full` are the torch backend's
(`token_logprobs`): one row, positions restarting; per-sequence attention by default; the LM head
chunked (trainer/forward/logprobs.py) on the root's unsharded head weight.

Mixtures of experts (Qwen3-MoE): the router's balancing loss per micro-batch, weighted by its
share of the whole minibatch's tokens (trainer/fsdp/moe.py says what each rank computes it over);
`trainer.routing_replay=rollout` through the torch backend's router hook (the routes travel with
the broadcast batch). Weights under the checkpoint's names (per expert), rank 0 the one sender:
trainer/fsdp/export.py. Sharding, checkpoints and the HF directory: trainer/fsdp/state.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from areal_jobs.api import TensorSpec
from areal_jobs.config import AlgoConfig, DType, LoraConfig, Recompute, RoutingReplay, TrainerConfig
from areal_jobs.trainer.dist.state_bytes import trainer_state_bytes
from areal_jobs.trainer.forward import lora as lora_adapters
from areal_jobs.trainer.forward.attention import hf_attn_implementation
from areal_jobs.trainer.forward.hf_logprobs import enable_layer_recompute, token_logprobs
from areal_jobs.trainer.forward.layer_compile import check_compile_device, compile_layers, hf_decoder_layers
from areal_jobs.trainer.forward.logprobs import resolve_kernel
from areal_jobs.trainer.forward.packed_attention import check_attention_device
from areal_jobs.trainer.forward.routing_replay import replay_token_fraction, require_routers, routers
from areal_jobs.trainer.fsdp import export as fsdp_export
from areal_jobs.trainer.fsdp import state as fsdp_state
from areal_jobs.trainer.fsdp.dist import (  # noqa: F401 - init/shutdown: trainer/backends.py imports them here
    init_distributed,
    reduce_step,
    shutdown_distributed,
    sum_over_ranks,
)
from areal_jobs.trainer.fsdp.moe import router_metrics_over_ranks
from areal_jobs.trainer.intake.batch import TrainBatch, TrainSample
from areal_jobs.trainer.intake.batch_broadcast import broadcast_train_batch
from areal_jobs.trainer.intake.dp_plan import plan_microbatches
from areal_jobs.trainer.intake.minibatches import (
    loss_inputs,
    prox_from_gradient_pass,
    split_minibatches,
    step_weights,
)
from areal_jobs.trainer.objective.loss import LossStats, ppo_loss, pre_step_logp
from areal_jobs.trainer.objective.objectives import step_lr_scale
from areal_jobs.trainer.objective.router_loss import RouterLoss, has_router, resolve_coef

logger = logging.getLogger(__name__)


class FSDPBackend:
    """`TrainBackend` on FSDP2. Construct anywhere (no I/O); `setup()` on every rank."""

    def __init__(
        self,
        trainer_cfg: TrainerConfig,
        algo: AlgoConfig,
        model_path: str,
        dtype: DType,
        lora: LoraConfig | None = None,
        *,
        temperature: float = 1.0,
    ) -> None:
        if trainer_cfg.fsdp_mixed_precision and dtype is not DType.float32:
            raise ValueError(
                "trainer.fsdp_mixed_precision=true keeps float32 parameters and computes in bfloat16: "
                f"set model.dtype=float32 (not {dtype.value}), or trainer.fsdp_mixed_precision=false"
            )
        self.cfg = trainer_cfg
        self.algo = algo
        self.model_path = model_path
        self.dtype = dtype
        self.temperature = temperature  # rollout.temperature: the policy that sampled the batch
        self.lora = lora or LoraConfig()  # rank > 0: only the adapters train, sharded with their layer
        self.model: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None  # frozen initial weights, for algo.kl_coef > 0
        self.optimizer: torch.optim.Optimizer | None = None

    def setup(self) -> None:
        """Load the HF model on every rank, shard it, build AdamW over the shards. Collective."""
        from transformers import AutoModelForCausalLM

        if not dist.is_initialized():
            init_distributed(self.cfg)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        torch.manual_seed(self.cfg.seed)
        self.kernel = resolve_kernel(self.cfg.logprob_kernel, self.device)
        check_attention_device(self.cfg.attention.value, self.device)
        if self.cfg.compile:
            check_compile_device(self.device)
        model = AutoModelForCausalLM.from_pretrained(
            self.model_path,
            dtype=getattr(torch, self.dtype.value),
            attn_implementation=hf_attn_implementation(self.cfg.attention),
        )
        self.router_coef = resolve_coef(model, self.cfg.router_aux_loss_coef)  # trainer/fsdp/moe.py
        self.replay = self.cfg.routing_replay is RoutingReplay.rollout
        if self.replay:
            require_routers(bool(routers(model)), self.model_path)
        if self.lora.enabled:  # before sharding: the adapters are sharded with their decoder layer
            lora_adapters.apply_lora(model, self.lora, self.cfg.seed)
        if self.cfg.recompute is Recompute.full:  # before fully_shard: per decoder layer
            enable_layer_recompute(model)
        if self.cfg.compile:  # after recompute, before fully_shard (torchtitan's order)
            compile_layers(hf_decoder_layers(model))
        self.architecture = type(model).__name__  # fully_shard renames the class: export the original
        self.model = fsdp_state.shard(model, self.cfg.fsdp_mixed_precision, self.device)
        self.model.train()
        if self.algo.kl_coef > 0:
            reference = AutoModelForCausalLM.from_pretrained(
                self.model_path,
                dtype=getattr(torch, self.dtype.value),
                attn_implementation=hf_attn_implementation(self.cfg.attention),
            ).requires_grad_(False)
            self.reference = fsdp_state.shard(reference, self.cfg.fsdp_mixed_precision, self.device).eval()
        self.optimizer = torch.optim.AdamW(
            lora_adapters.trainable_parameters(self.model),
            lr=self.cfg.lr,
            betas=(self.cfg.adam_beta1, self.cfg.adam_beta2),
            weight_decay=self.cfg.weight_decay,
        )

    # ------------------------------------------------------------------ training

    def _logprobs(self, samples: list[TrainSample], *, with_entropy: bool = False, model=None, router=None):
        """This rank's micro-batch under `model` (the policy by default); an empty one runs a
        two-token stand-in through the same path (FSDP all-gathers and reduce-scatters are
        collective: every rank must touch the same parameters) and returns [] with a zero `dummy`
        attached for the backward. With `with_entropy`, (log-probs, entropies) as token_logprobs
        returns them (the entropies with gradient when algo.entropy_coef > 0). `router`: the
        forward's balancing loss goes there; the policy's forwards replay the rollout's routes
        (trainer.routing_replay=rollout; the reference model keeps its own routing)."""
        model = self.model if model is None else model
        assert model is not None
        kwargs = dict(
            device=self.device,
            temperature=self.temperature,
            chunk_tokens=self.cfg.logprob_chunk_tokens,
            kernel=self.kernel,
        )
        if samples:
            return token_logprobs(
                model,
                samples,
                with_entropy=with_entropy,
                entropy_grad=self.algo.entropy_coef > 0,
                router=router,
                replay=self.replay and model is self.model,
                **kwargs,
            )
        stand_in = TrainSample(
            "", np.zeros(2, np.int64), 1, np.zeros(1, np.float32), np.zeros(1, np.int32), 0.0, 0.0
        )
        self._dummy = token_logprobs(model, [stand_in], **kwargs)[0].sum() * 0.0
        return ([], []) if with_entropy else []

    def train_step(self, batch: TrainBatch | None) -> dict[str, float]:
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        t0 = time.perf_counter()
        batch = broadcast_train_batch(batch, self.device) if self.world > 1 else batch
        assert batch is not None, "trainer rank 0 must pass the batch"
        samples = batch.samples
        if not samples:
            return {"train/skipped_empty_batch": 1.0}
        lengths = [len(s.input_ids) for s in samples]
        outputs = [s.num_output_tokens for s in samples]
        budget = self.cfg.max_tokens_per_microbatch
        behav = {i: torch.from_numpy(s.behav_logprobs) for i, s in enumerate(samples)}
        minibatches = split_minibatches(samples, self.algo)
        # this rank's micro-batches (sample indices) of each optimiser step; every pass below runs
        # exactly these, so a sample's p and reference log-probs are computed on the rank that
        # trains it, and every rank runs the same count (the FSDP collectives stay in step)
        steps = [
            [
                [minibatch[j] for j in local]
                for local in plan_microbatches([lengths[i] for i in minibatch], self.world, budget)[self.rank]
            ]
            for minibatch in minibatches
        ]
        prox = dict(behav)  # standard PPO: the behaviour policy is the trust-region anchor
        gap = torch.zeros(2, dtype=torch.float64)  # sum |prox - behav| and tokens, this rank
        # prox_logp=current: the first minibatch's gradient pass runs the pre-step weights and
        # supplies p for its own samples; the pass below covers only the others
        from_gradient_pass = prox_from_gradient_pass(self.algo, minibatches)
        with torch.no_grad():
            for k, step in enumerate(steps):
                if not self.algo.decoupled or (k == 0 and from_gradient_pass):
                    continue
                for mb in step:
                    for i, lp in zip(mb, self._logprobs([samples[i] for i in mb])):
                        prox[i] = lp.detach().cpu()
                        gap += torch.tensor([float((prox[i] - behav[i]).abs().sum()), outputs[i]])
        ref: dict[int, torch.Tensor] = {}
        if self.reference is not None:
            with torch.no_grad():
                for mb in (mb for step in steps for mb in step):
                    for i, lp in zip(mb, self._logprobs([samples[i] for i in mb], model=self.reference)):
                        ref[i] = lp.detach().cpu()
        t_prox = time.perf_counter()
        stats, total_loss, grad_norms, num_micro, lr_scales = LossStats(), 0.0, [], 0, []
        router = RouterLoss(self.router_coef) if has_router(self.model) else None
        for k, (minibatch, step) in enumerate(zip(minibatches, steps, strict=True)):
            # aggregation weights over this optimiser step's samples (loss.py), the same on every rank
            agg = step_weights(samples, minibatch, self.algo, batch.max_new_tokens)
            minibatch_tokens = sum(lengths[i] for i in minibatch)  # every rank's: the weights sum to 1
            self.optimizer.zero_grad(set_to_none=True)
            step_stats = LossStats()  # this optimiser step's on this rank: algo.ess_step reads them
            for mb in step:
                num_micro += 1
                logp, entropy = self._logprobs([samples[i] for i in mb], with_entropy=True, router=router)
                if not mb:
                    (self._dummy * self.world).backward()
                    continue
                if k == 0 and from_gradient_pass:
                    for i, lp in zip(mb, logp):
                        prox[i] = lp.detach().cpu()
                        gap += torch.tensor([float((prox[i] - behav[i]).abs().sum()), outputs[i]])
                logp_mb = torch.cat(logp).cpu() if self.device is not None else torch.cat(logp)
                prox_mb = torch.cat([prox[i] for i in mb])
                loss, mb_stats = ppo_loss(
                    logp_mb,
                    prox_mb,
                    torch.cat([behav[i] for i in mb]),
                    **loss_inputs([samples[i] for i in mb], [agg[i] for i in mb]),
                    algo=self.algo,
                    entropy=torch.cat(entropy).cpu(),
                    ref_logp=torch.cat([ref[i] for i in mb]) if ref else None,
                    pre_logp=pre_step_logp(self.algo, prox_mb, logp_mb, first_minibatch=k == 0),
                )
                total_loss += float(loss.detach())
                if router is not None:  # this micro-batch's own balancing loss (trainer/fsdp/moe.py)
                    loss = loss + router.take(sum(lengths[i] for i in mb) / minibatch_tokens)
                (loss * self.world).backward()
                stats.add(mb_stats)
                step_stats.add(mb_stats)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            grad_norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
            lr_scales.append(step_lr_scale(self.algo, self.optimizer, step_stats, sum_over_ranks))
            self.optimizer.step()
        t_end = time.perf_counter()
        total_loss, stats, gap, num_micro = reduce_step(total_loss, stats, gap, num_micro)
        router_metrics = router_metrics_over_ranks(router, sum_over_ranks) if router is not None else {}
        return {
            "train/loss": total_loss / len(grad_norms),  # mean over the minibatches' token-mean losses
            "train/grad_norm": max(grad_norms),
            "train/lr_scale": sum(lr_scales) / len(lr_scales),  # algo.ess_step (1 when off)
            "train/num_tokens": float(batch.num_output_tokens),
            "train/num_sequences": float(len(samples)),
            "train/num_microbatches": float(num_micro),
            "train/num_minibatches": float(len(grad_norms)),
            "train/prox_behav_abs_diff": float(gap[0] / gap[1]) if self.algo.decoupled else 0.0,
            "time/prox_logp_s": t_prox - t0,
            "time/train_s": t_end - t0,
            **stats.to_metrics(),
            **router_metrics,
            **(
                {"train/routing_replay_token_fraction": replay_token_fraction(samples)} if self.replay else {}
            ),
            **trainer_state_bytes(self.model, self.optimizer),  # this rank's shards
        }

    # ------------------------------------------------------------------ weights (trainer/fsdp/export.py)

    def weight_specs(self) -> list[TensorSpec]:
        assert self.model is not None, "call setup() first"
        return fsdp_export.weight_specs(self.model, self.rank)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: every rank must call it (rank 0 yields, the others join the gathers)."""
        assert self.model is not None, "call setup() first"
        return fsdp_export.iter_weights(self.model, self.rank, self.lora)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str) -> None:
        assert self.model is not None and self.optimizer is not None
        fsdp_state.save_sharded(self.model, self.optimizer, path, adapters_only=self.lora.enabled)

    def load_checkpoint(self, path: str) -> None:
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        fsdp_state.load_sharded(self.model, self.optimizer, path, adapters_only=self.lora.enabled)

    def save_hf(self, path: str) -> None:
        assert self.model is not None
        tensors = dict(self.iter_weights())  # the checkpoint's names (per-expert for an MoE)
        if self.rank == 0:
            fsdp_state.write_hf(path, tensors, self.model.config, self.architecture, self.model_path)
        if self.world > 1:
            dist.barrier()

    def save_adapter(self, path: str) -> None:
        """LoRA: the adapters alone as a PEFT directory (collective: every rank joins the gathers)."""
        assert self.model is not None and self.lora.enabled, "save_adapter needs model.lora.rank > 0"
        fsdp_export.save_adapter(self.model, self.rank, self.lora, self.model_path, path)
