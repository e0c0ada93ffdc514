"""Megatron-Core trainer backend: GPTModel with TP/PP/DP behind the `TrainBackend` protocol.

A drop-in for the torch backend: same batches in, same loss, HF-named weights out.
One `train_step`:
  1. rank 0's TrainBatch is broadcast (transport/batch_codec.py bytes, no pickle); it is split
     into the `algo.ppo_minibatches` token-balanced minibatches
     (minibatches.split_minibatches); each minibatch's samples are split over DP ranks
     (balanced by tokens) and packed into micro-batches under `trainer.max_tokens_per_microbatch`,
     with the same number of micro-batches on every DP rank (padded with empty ones);
  2. before the first optimiser step, forward-only passes with the pre-step weights: proximal
     log-probs for the samples the gradient pass does not supply (minibatches.
     prox_from_gradient_pass: with algo.prox_logp=current only the later minibatches', since the
     first minibatch's gradient pass runs those very weights; recompute: all), and with
     algo.kl_coef > 0 the reference log-probs of every sample from a frozen second GPTModel
     with the policy's TP/PP layout (no DDP, no optimiser);
  3. per minibatch, forward/backward of the decoupled PPO loss over its micro-batches through
     Megatron's schedule (megatron/schedule.py). Each micro-batch's loss is already divided by
     the output-token count of its minibatch (trainer/objective/loss.py), so gradients are summed over
     micro-batches and DP ranks, never averaged; then clipping at `trainer.grad_clip` and one
     AdamW step of Megatron's distributed optimizer.
Log-probs and entropy: the last stage returns the final hidden states and megatron/head.py
applies the output weight vocab-parallel, `trainer.logprob_chunk_tokens` output positions at a
time, at `rollout.temperature`; the padded vocab columns are left out, so the softmax is over the
HF vocab exactly.
Packing: one row per micro-batch, its sequences' boundaries as THD PackedSeqParams for
TransformerEngine's attention or, without TE, for our per-sequence core attention
(megatron/attention.py: trainer.attention=varlen, varlen_attn or flex); trainer.attention=dense
gives the local spec a block-diagonal causal [T, T] mask instead. trainer.recompute: Megatron's
activation recomputation (model.recompute_settings). trainer.compile: each TransformerLayer
compiled (trainer/forward/layer_compile.py); trainer.logprob_kernel: the head's softmax side.
trainer.routing_replay=rollout: the policy's MoE routers take the samples' expert routes, packed
with each micro-batch (megatron/routing_replay.py); the reference model keeps its own routing.

Who does what: every method runs on every trainer rank at once. `weight_specs`/`iter_weights`
gather TP shards collectively; the TP-rank-0, DP-rank-0 rank of each pipeline stage is that
stage's sender and the only rank that yields (its own layers, HF names and dtype).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import Float16Module

from areal_jobs.api import TensorSpec
from areal_jobs.config import AlgoConfig, Attention, DType, TrainerConfig
from areal_jobs.trainer.forward.layer_compile import (
    check_compile_device,
    compile_layers,
    megatron_decoder_layers,
)
from areal_jobs.trainer.forward.logprobs import resolve_kernel
from areal_jobs.trainer.forward.packed_attention import check_attention_device
from areal_jobs.trainer.forward.routing_replay import replay_token_fraction
from areal_jobs.trainer.intake.batch import TrainBatch, TrainSample
from areal_jobs.trainer.intake.batch_broadcast import broadcast_train_batch
from areal_jobs.trainer.intake.dp_plan import plan_microbatches
from areal_jobs.trainer.intake.minibatches import prox_from_gradient_pass, split_minibatches, step_weights
from areal_jobs.trainer.megatron import model as megatron_model
from areal_jobs.trainer.megatron import router_aux, routing_replay, schedule
from areal_jobs.trainer.megatron import weights as megatron_weights
from areal_jobs.trainer.megatron.convert import ModelDims, ParamMap, param_maps
from areal_jobs.trainer.megatron.dist import init_distributed
from areal_jobs.trainer.megatron.head import OutputHead
from areal_jobs.trainer.megatron.microbatch import MicroBatch, build_microbatch
from areal_jobs.trainer.objective.objectives import step_lr_scale

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {DType.float32: torch.float32, DType.bfloat16: torch.bfloat16}


class MegatronBackend:
    """`TrainBackend` on Megatron-Core. Construct anywhere (no I/O); `setup()` after
    `init_distributed`, on every rank."""

    def __init__(
        self,
        trainer_cfg: TrainerConfig,
        algo: AlgoConfig,
        model_path: str,
        dtype: DType,
        *,
        temperature: float = 1.0,
    ) -> None:
        if dtype not in _TORCH_DTYPES:
            raise ValueError(
                f"trainer=megatron trains in float32 or bfloat16: set model.dtype=bfloat16, not {dtype.value}"
            )
        self._cfg = trainer_cfg
        self._algo = algo
        self._model_path = model_path
        self._dtype = _TORCH_DTYPES[dtype]
        self._temperature = temperature  # rollout.temperature: the policy that sampled the batch
        # bf16: the last stage's hidden states stay bf16 (Float16Module would upcast them to fp32)
        self._fp32_output = self._dtype == torch.float32

    # ------------------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Build this stage's model, load the HF weights, wrap in DDP, build the optimizer.
        Runs `init_distributed` first if nobody has (a lone trainer process)."""
        cfg = self._cfg
        if not parallel_state.model_parallel_is_initialized():
            init_distributed(cfg)
        self.dims = ModelDims.from_hf_config(
            megatron_model.read_hf_config(self._model_path),
            vocab_multiple=cfg.megatron_vocab_multiple,
        )
        self.dims.check_layout(cfg.tp_size, cfg.pp_size, cfg.ep_size, cfg.expert_tp_size)
        self._aux_coef = router_aux.resolve_router_coef(self.dims, cfg.router_aux_loss_coef)
        self._experts = megatron_weights.ExpertLayout.current()
        self._use_te = megatron_model.use_transformer_engine()
        if self._use_te and cfg.attention is not Attention.varlen:
            raise ValueError(
                f"trainer.attention={cfg.attention.value} is the local spec's attention; with TransformerEngine "
                "installed the trainer attends per sequence with TE's THD kernels: set trainer.attention=varlen"
            )
        # the sequences' boundaries as THD PackedSeqParams (TE's attention or ours), else a dense mask
        self._thd = self._use_te or cfg.attention is not Attention.dense
        self._device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        )
        check_attention_device(cfg.attention.value, self._device)
        if cfg.compile:
            check_compile_device(self._device)
        self._kernel = resolve_kernel(cfg.logprob_kernel, self._device)
        self._tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self._pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self._dp_rank = parallel_state.get_data_parallel_rank()
        self._maps = param_maps(
            self.dims,
            pp_size=cfg.pp_size,
            pp_rank=self._pp_rank,
            te_fused_norms=self._use_te,
            ep_size=cfg.ep_size,
            ep_rank=self._experts.ep_rank,
        )
        config = megatron_model.transformer_config(
            self.dims,
            tp_size=cfg.tp_size,
            pp_size=cfg.pp_size,
            params_dtype=self._dtype,
            use_te=self._use_te,
            recompute=cfg.recompute,
            ep_size=cfg.ep_size,
            expert_tp_size=cfg.expert_tp_size,
            router_aux_loss_coef=self._aux_coef,
        )
        self._config = config
        self._gpt = self._load_gpt(config)
        self._replay = routing_replay.for_model(cfg, self.dims.is_moe, self._gpt, self._model_path)
        if cfg.compile:
            compile_layers(megatron_decoder_layers(self._gpt))
        module = Float16Module(config, self._gpt) if self._dtype != torch.float32 else self._gpt
        # algo.kl_coef > 0: the initial weights, frozen, sharded like the policy (same TP/PP
        # layout, its own config so no DDP hook reaches it); used forward-only, once per batch
        self._reference: torch.nn.Module | None = None
        self._ref_head: OutputHead | None = None
        if self._algo.kl_coef > 0:
            ref_config = megatron_model.transformer_config(
                self.dims,
                tp_size=cfg.tp_size,
                pp_size=cfg.pp_size,
                params_dtype=self._dtype,
                use_te=self._use_te,
                ep_size=cfg.ep_size,
                expert_tp_size=cfg.expert_tp_size,
            )  # no recompute, no load-balancing loss: it never runs a backward
            ref = self._load_gpt(ref_config).requires_grad_(False).eval()
            self._reference = Float16Module(ref_config, ref) if self._dtype != torch.float32 else ref
            self._ref_head = self._output_head(ref)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=True,
        )
        self._ddp = DistributedDataParallel(config, ddp_config, module)
        config.no_sync_func = self._ddp.no_sync
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            clip_grad=cfg.grad_clip,
            bf16=self._dtype == torch.bfloat16,
            params_dtype=self._dtype,
            use_distributed_optimizer=True,
        )
        # {} = one group, weight decay on every parameter, as the torch backend's AdamW does
        self._optimizer = get_megatron_optimizer(opt_config, [self._ddp], config_overrides={})
        self._head = self._output_head(self._gpt)
        self._ppo_loss = partial(schedule.ppo_step_loss, self._head, self._algo)

    def _load_gpt(self, config) -> torch.nn.Module:
        cfg = self._cfg
        return megatron_weights.load_gpt(
            self.dims, config, self._model_path, tp_size=cfg.tp_size, tp_rank=self._tp_rank,
            pp_size=cfg.pp_size, pp_rank=self._pp_rank, use_te=self._use_te, attention=cfg.attention,
            experts=self._experts,
        )  # fmt: skip

    def _output_head(self, gpt) -> OutputHead:
        return OutputHead(
            gpt,
            self.dims,
            tp_size=self._cfg.tp_size,
            tp_rank=self._tp_rank,
            temperature=self._temperature,
            chunk_tokens=self._cfg.logprob_chunk_tokens,
            kernel=self._kernel,
        )

    # ------------------------------------------------------------------------------ training

    def train_step(self, batch: TrainBatch | None) -> dict[str, float]:
        start = time.perf_counter()
        batch = broadcast_train_batch(batch, self._device)
        if not batch.samples:
            return {"train/skipped_empty_batch": 1.0}
        samples = batch.samples
        lengths = [len(s.input_ids) for s in samples]
        minibatches = split_minibatches(samples, self._algo)
        steps: list[list[MicroBatch]] = []  # this DP rank's micro-batches, per optimiser step
        for minibatch in minibatches:
            agg = step_weights(samples, minibatch, self._algo, batch.max_new_tokens)
            plan = plan_microbatches(
                [lengths[i] for i in minibatch], self._cfg.dp_size, self._cfg.max_tokens_per_microbatch
            )
            steps.append(
                [
                    build_microbatch(
                        [samples[minibatch[j]] for j in local],
                        [agg[minibatch[j]] for j in local],
                        device=self._device,
                        thd=self._thd,
                        replay=self._replay is not None,
                    )
                    for local in plan[self._dp_rank]
                ]
            )

        for mb in steps[0]:
            mb.first_minibatch = True
        # prox_logp=current leaves the first minibatch's mb.prox_logp None: _ppo_loss takes the
        # gradient pass's own log-probs, which run the pre-step weights
        from_gradient_pass = prox_from_gradient_pass(self._algo, minibatches)
        if not self._algo.decoupled:
            for mb in (mb for step in steps for mb in step):
                mb.prox_logp = mb.behav_logp
        else:
            need = [mb for k, step in enumerate(steps) if not (k == 0 and from_gradient_pass) for mb in step]
            if need:  # the same micro-batch count on every rank: the schedules stay in step
                for mb, logp in schedule.forward_logp(
                    self._ddp, self._head, need, fp32_output=self._fp32_output, replay=self._replay
                ):
                    mb.prox_logp = logp
        if self._reference is not None:
            all_mbs = [mb for step in steps for mb in step]
            logps = schedule.forward_logp(
                self._reference, self._ref_head, all_mbs, fp32_output=self._fp32_output
            )
            for mb, logp in logps:
                mb.ref_logp = logp
        prox_s = time.perf_counter() - start

        outputs, grad_norms, lr_scales, router_sums = [], [], [], []
        for step, minibatch in zip(steps, minibatches, strict=True):
            if self._aux_coef:  # megatron/router_aux.py: weighted per routed token, as the torch backend
                routed = sum(lengths[i] for i in minibatch)
                self._config.moe_aux_loss_coeff = router_aux.per_token_coef(self._aux_coef, routed)
                router_aux.clear_tracked()
            self._ddp.zero_grad_buffer()
            self._optimizer.zero_grad()
            step_outputs = schedule.run_schedule(
                self._ddp, step, self._ppo_loss, forward_only=False, fp32_output=self._fp32_output,
                replay=self._replay,
            )  # fmt: skip
            outputs += step_outputs
            if self._aux_coef:
                router_sums.append(router_aux.tracked_sum())
            finalize_model_grads([self._ddp])
            lr_scales.append(
                step_lr_scale(
                    self._algo,
                    self._optimizer,
                    schedule.step_stats(step_outputs),
                    partial(schedule.sum_over_ranks, device=self._device),
                )
            )
            update_ok, grad_norm, _ = self._optimizer.step()
            if not update_ok:
                raise RuntimeError("Megatron optimizer step was skipped (non-finite gradients)")
            grad_norms.append(float(grad_norm or 0.0))
        microbatches = [mb for step in steps for mb in step]
        metrics = schedule.reduce_metrics(
            outputs, microbatches, num_global_tokens=float(batch.num_output_tokens), device=self._device
        )
        if router_sums:  # Megatron's definition, on the torch backend's scale (router_aux.py)
            (total,) = schedule.sum_over_ranks([sum(router_sums)], device=self._device)
            metrics["train/router_aux_loss"] = router_aux.logged_value(
                total, self.dims, tp_size=self._cfg.tp_size, dp_size=self._cfg.dp_size,
                microbatches=len(microbatches),
            )  # fmt: skip
            metrics["train/router_aux_loss_coef"] = self._aux_coef
        if self._replay is not None:  # as the torch backend logs it
            metrics["train/routing_replay_token_fraction"] = replay_token_fraction(samples)
        return {
            **metrics,
            "train/loss": metrics["train/loss"] / len(steps),  # mean over the minibatches' losses
            "train/grad_norm": max(grad_norms),
            "train/lr_scale": sum(lr_scales) / len(lr_scales),  # algo.ess_step (1 when off)
            "train/num_tokens": float(batch.num_output_tokens),
            "train/num_sequences": float(len(batch.samples)),
            "train/num_microbatches": float(len(microbatches)),
            "train/num_minibatches": float(len(steps)),
            "time/prox_logp_s": prox_s,
            "time/train_s": time.perf_counter() - start,
        }

    @torch.no_grad()
    def full_logits(
        self, sequences: Sequence[np.ndarray], routes: Sequence[np.ndarray | None] | None = None
    ) -> torch.Tensor | None:
        """Evaluation forward of packed sequences -> untempered logits over the HF vocab [T, V]
        (float32, the whole tensor: evaluation and tests only), on the last pipeline stage's
        ranks (None on the others). Collective over all ranks. `routes` (one per sequence, with
        trainer.routing_replay=rollout): the experts to replay."""
        empty = (np.zeros(0, np.float32), np.zeros(0, np.int32), 0.0, 0.0)
        replay = self._replay is not None and routes is not None
        samples = [
            TrainSample("", np.asarray(s, np.int64), len(s), *empty, routes=r)
            for s, r in zip(sequences, routes if replay else [None] * len(sequences), strict=True)
        ]
        outputs = schedule.run_schedule(
            self._ddp,
            [build_microbatch(samples, device=self._device, thd=self._thd, replay=replay)],
            partial(schedule.logits_loss, self._head),
            forward_only=True,
            fp32_output=self._fp32_output,
            replay=self._replay,
        )
        return outputs[0]["logits"] if outputs else None

    # ------------------------------------------------------------------------------ weights out

    def _exported_maps(self) -> list[ParamMap]:
        return [pm for pm in self._maps if pm.exported]

    def weight_specs(self) -> list[TensorSpec]:
        if self._dp_rank != 0 or self._tp_rank != 0:
            return []
        return megatron_weights.hf_specs(self._exported_maps(), self.dims, self._dtype, self._cfg.ep_size)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Senders get a generator; the other TP ranks of DP rank 0 and, for an MoE, the other
        expert ranks of expert-DP rank 0 join the gathers eagerly (their call returns once the
        sender has iterated everything)."""
        dense = self._dp_rank == 0
        experts = self.dims.is_moe and self._experts.edp_rank == 0
        if not dense and not experts:
            return iter(())
        tensors = megatron_weights.gathered_hf_tensors(
            self._gpt, self._exported_maps(), self.dims, self._dtype, self._cfg.tp_size, self._tp_rank,
            dense=dense, experts=self._experts,
        )  # fmt: skip
        if dense and self._tp_rank == 0:
            return tensors
        for _ in tensors:
            pass
        return iter(())

    def save_hf(self, path: str) -> None:
        """HF directory: each stage's sender writes its own safetensors shard, rank 0 the config,
        tokenizer files and the shard index. Collective."""
        megatron_weights.save_hf_dir(
            Path(path), self.iter_weights, self._pp_rank, self._cfg.pp_size,
            self._model_path, self.dims, self._dtype, te_fused_norms=self._use_te,
        )  # fmt: skip

    # ------------------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str) -> None:
        """Megatron dist checkpoint of model + distributed optimizer; any TP/PP/DP layout loads it."""
        megatron_weights.save_dist_checkpoint(self._gpt, self._optimizer, path)

    def load_checkpoint(self, path: str) -> None:
        megatron_weights.load_dist_checkpoint(self._gpt, self._optimizer, path)
