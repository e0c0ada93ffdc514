"""Plain-torch trainer backend: a Hugging Face causal LM, one process, packed micro-batches.

Per step: (1) proximal log-probs p with the pre-step weights. With algo.prox_logp=current (the
default) the first minibatch's gradient pass runs exactly those weights, so its own log-probs,
detached, are p: only the samples of later minibatches need a no-grad pass (none with one
minibatch). recompute runs that pass over every sample; loglinear interpolates p per micro-batch
from the behaviour log-probs, the current ones and the token versions (loss.py). (2) the batch is
split into `algo.ppo_minibatches` token-balanced minibatches; for each, the decoupled PPO loss
over its balanced micro-batches with gradients accumulated, normalised by the minibatch's output
tokens, then clip and one AdamW step. Later minibatches see a policy that already moved: the
clip on r = exp(θ - p) keeps it near the proximal policy.

Packing: a micro-batch is one row [1, T] of concatenated sequences whose position ids restart
at 0. trainer.attention=varlen (the default) attends within each sequence from the packing
boundaries (trainer/forward/attention.py, no [T, T] mask); dense lets transformers build the
block-diagonal causal mask. Either way sequences never see each other.
trainer.recompute=full recomputes each decoder layer in backward (transformers' gradient
checkpointing); selective is Megatron's and refused by the config here. trainer.compile compiles
each decoder layer (trainer/forward/layer_compile.py); trainer.logprob_kernel picks the LM head's softmax
side (logprobs.resolve_kernel: torch on CPU).

Device: CPU unless the constructor is given one (`device=`, the GPU bench: bench/trainer/gpu_trainer.py);
on a GPU the model, the packed row and the head run there and the per-token log-probs come back
to the CPU (a differentiable copy) for the loss, as in the FSDP2 backend.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from areal_jobs.api import TensorSpec
from areal_jobs.config import AlgoConfig, DType, LoraConfig, Recompute, RoutingReplay, TrainerConfig
from areal_jobs.config.algo import ProxLogp
from areal_jobs.trainer.dist.state_bytes import trainer_state_bytes
from areal_jobs.trainer.forward import lora as lora_adapters
from areal_jobs.trainer.forward.attention import hf_attn_implementation
from areal_jobs.trainer.forward.hf_logprobs import enable_layer_recompute, token_logprobs
from areal_jobs.trainer.forward.layer_compile import check_compile_device, compile_layers, hf_decoder_layers
from areal_jobs.trainer.forward.logprobs import resolve_kernel
from areal_jobs.trainer.forward.packed_attention import check_attention_device
from areal_jobs.trainer.forward.routing_replay import replay_token_fraction, require_routers, routers
from areal_jobs.trainer.intake.batch import TrainBatch, TrainSample
from areal_jobs.trainer.intake.minibatches import (
    loss_inputs,
    prox_from_gradient_pass,
    split_minibatches,
    step_weights,
)
from areal_jobs.trainer.intake.packing import balanced_microbatches
from areal_jobs.trainer.objective.loss import LossStats, loglinear_prox_logp, ppo_loss, pre_step_logp
from areal_jobs.trainer.objective.objectives import step_lr_scale
from areal_jobs.trainer.objective.router_loss import RouterLoss, has_router, resolve_coef

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class TorchBackend:
    """api.TrainBackend over a transformers causal LM (the CPU and small-run backend)."""

    def __init__(
        self,
        trainer_cfg: TrainerConfig,
        algo: AlgoConfig,
        model_path: str,
        dtype: DType,
        lora: LoraConfig | None = None,
        *,
        temperature: float = 1.0,
        device: torch.device | str | None = None,
    ) -> None:
        self.cfg = trainer_cfg
        self.algo = algo
        self.model_path = model_path
        self.dtype = dtype
        self.temperature = temperature  # rollout.temperature: the policy that sampled the batch
        self.lora = lora or LoraConfig()  # rank > 0: only the adapters train (trainer/forward/lora.py)
        self.device = torch.device(device) if device is not None else None  # None: CPU
        self.kernel = resolve_kernel(trainer_cfg.logprob_kernel, self.device)
        self.model: torch.nn.Module | None = None
        self.reference: torch.nn.Module | None = None  # frozen initial weights, for algo.kl_coef > 0
        self.optimizer: torch.optim.Optimizer | None = None

    def setup(self) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(self.cfg.seed)
        check_attention_device(self.cfg.attention.value, self.device)
        attention = hf_attn_implementation(self.cfg.attention)
        if self.cfg.compile:
            check_compile_device(self.device)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=getattr(torch, self.dtype.value), attn_implementation=attention
        ).to(self.device)
        if self.lora.enabled:
            lora_adapters.apply_lora(self.model, self.lora, self.cfg.seed)
        self.router_coef = resolve_coef(self.model, self.cfg.router_aux_loss_coef)
        if self.cfg.routing_replay is RoutingReplay.rollout:
            require_routers(bool(routers(self.model)), self.model_path)
        if self.cfg.recompute is Recompute.full:
            enable_layer_recompute(self.model)
        if self.cfg.compile:
            compile_layers(hf_decoder_layers(self.model))
        self.model.train()
        if self.algo.kl_coef > 0:
            self.reference = (
                AutoModelForCausalLM.from_pretrained(
                    self.model_path, dtype=getattr(torch, self.dtype.value), attn_implementation=attention
                )
                .to(self.device)
                .eval()
            )
            self.reference.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            lora_adapters.trainable_parameters(self.model),
            lr=self.cfg.lr,
            betas=(self.cfg.adam_beta1, self.cfg.adam_beta2),
            weight_decay=self.cfg.weight_decay,
        )

    # ------------------------------------------------------------------ training

    def _logprobs(self, model: torch.nn.Module, samples: list[TrainSample], with_entropy=False, **kwargs):
        """token_logprobs of the tempered policy, chunked as trainer.logprob_chunk_tokens says, on
        the CPU (from the GPU by one differentiable copy per micro-batch)."""
        out = token_logprobs(
            model,
            samples,
            self.device,
            temperature=self.temperature,
            chunk_tokens=self.cfg.logprob_chunk_tokens,
            kernel=self.kernel,
            with_entropy=with_entropy,
            # the policy's forwards only: the reference model keeps its own routing
            replay=self.cfg.routing_replay is RoutingReplay.rollout and model is self.model,
            **kwargs,
        )
        if self.device is None or self.device.type == "cpu":
            return out
        sizes = [s.num_output_tokens for s in samples]
        parts = [torch.cat(part).cpu().split(sizes) for part in (out if with_entropy else (out,))]
        return (list(parts[0]), list(parts[1])) if with_entropy else list(parts[0])

    def train_step(self, batch: TrainBatch | None) -> dict[str, float]:
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        assert batch is not None, "the torch backend runs one process: rank 0 always has the batch"
        t0 = time.perf_counter()
        samples = batch.samples
        if not samples:
            return {"train/skipped_empty_batch": 1.0}
        lengths = [len(s.input_ids) for s in samples]
        budget = self.cfg.max_tokens_per_microbatch
        behav = [torch.from_numpy(s.behav_logprobs) for s in samples]
        minibatches = split_minibatches(samples, self.algo)
        loglinear = self.algo.decoupled and self.algo.prox_logp is ProxLogp.loglinear
        from_gradient_pass = prox_from_gradient_pass(self.algo, minibatches)
        if not self.algo.decoupled:
            prox = behav  # standard PPO: the behaviour policy is the trust-region anchor
        else:
            prox: list[torch.Tensor] = [torch.empty(0)] * len(samples)  # loglinear: per micro-batch
            need = [] if loglinear else [i for i in range(len(samples)) if i not in from_gradient_pass]
            with torch.no_grad():
                for mb in balanced_microbatches([lengths[i] for i in need], budget):
                    for i, lp in zip(mb, self._logprobs(self.model, [samples[need[j]] for j in mb])):
                        prox[need[i]] = lp.detach()
        ref: list[torch.Tensor | None] = [None] * len(samples)
        if self.reference is not None:
            with torch.no_grad():
                for mb in balanced_microbatches(lengths, budget):
                    for i, lp in zip(mb, self._logprobs(self.reference, [samples[i] for i in mb])):
                        ref[i] = lp
        t_prox = time.perf_counter()
        stats, total_loss, grad_norms, num_micro, lr_scales = LossStats(), 0.0, [], 0, []
        router = RouterLoss(self.router_coef) if has_router(self.model) else None
        for k, minibatch in enumerate(minibatches):
            # aggregation weights over this optimiser step's samples (loss.py)
            agg = step_weights(samples, minibatch, self.algo, batch.max_new_tokens)
            minibatch_tokens = sum(lengths[i] for i in minibatch)
            self.optimizer.zero_grad(set_to_none=True)
            step_stats = LossStats()  # this optimiser step's: algo.ess_step reads them
            for local in balanced_microbatches([lengths[i] for i in minibatch], budget):
                mb = [minibatch[j] for j in local]
                num_micro += 1
                logp, entropy = self._logprobs(
                    self.model,
                    [samples[i] for i in mb],
                    with_entropy=True,
                    entropy_grad=self.algo.entropy_coef > 0,
                    router=router,
                )
                if loglinear:
                    for i, lp in zip(mb, logp):
                        prox[i] = loglinear_prox_logp(
                            behav[i], lp, torch.from_numpy(samples[i].versions), batch.version
                        )
                elif k == 0 and from_gradient_pass:
                    for i, lp in zip(mb, logp):
                        prox[i] = lp.detach()
                logp_mb, prox_mb = torch.cat(logp), torch.cat([prox[i] for i in mb])
                loss, mb_stats = ppo_loss(
                    logp_mb,
                    prox_mb,
                    torch.cat([behav[i] for i in mb]),
                    **loss_inputs([samples[i] for i in mb], [agg[i] for i in mb]),
                    algo=self.algo,
                    entropy=torch.cat(entropy),
                    ref_logp=torch.cat([ref[i] for i in mb]) if self.reference is not None else None,
                    pre_logp=pre_step_logp(self.algo, prox_mb, logp_mb, first_minibatch=k == 0),
                )
                total_loss += float(loss.detach())
                if router is not None:  # weighted by the micro-batch's share of the minibatch's tokens
                    loss = loss + router.take(sum(lengths[i] for i in mb) / minibatch_tokens)
                loss.backward()
                stats.add(mb_stats)
                step_stats.add(mb_stats)
            grad_norms.append(
                float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
            )
            lr_scales.append(step_lr_scale(self.algo, self.optimizer, step_stats))
            self.optimizer.step()
        t_end = time.perf_counter()
        num_tokens = float(batch.num_output_tokens)
        prox_gap = torch.cat([(p - b).abs() for p, b in zip(prox, behav)])
        return {
            "train/loss": total_loss / len(grad_norms),  # mean over the minibatches' token-mean losses
            "train/grad_norm": max(grad_norms),
            "train/lr_scale": sum(lr_scales) / len(lr_scales),  # algo.ess_step (1 when off)
            "train/num_tokens": num_tokens,
            "train/num_sequences": float(len(samples)),
            "train/num_microbatches": float(num_micro),
            "train/num_minibatches": float(len(grad_norms)),
            "train/prox_behav_abs_diff": float(prox_gap.mean()),
            "time/prox_logp_s": t_prox - t0,
            "time/train_s": t_end - t0,
            **stats.to_metrics(),
            **(router.metrics() if router is not None else {}),
            **self._replay_metrics(samples),
            **trainer_state_bytes(self.model, self.optimizer),
        }

    def _replay_metrics(self, samples: list[TrainSample]) -> dict[str, float]:
        """trainer.routing_replay=rollout: the share of output tokens predicted through replayed
        experts (1 - the last token's share when the engine reported every position)."""
        if self.cfg.routing_replay is not RoutingReplay.rollout:
            return {}
        return {"train/routing_replay_token_fraction": replay_token_fraction(samples)}

    # ------------------------------------------------------------------ weights

    def _export_state(self) -> dict[str, torch.Tensor]:
        assert self.model is not None, "call setup() first"
        state = self.model.state_dict()
        if self.lora.enabled:  # base + B·A·scale under the HF names (ship=merged, the disk fallback)
            state = lora_adapters.merged_state(state, self.lora.scaling)
        if getattr(self.model.config, "tie_word_embeddings", False):
            # an HF checkpoint of a tied model stores only the embedding
            state.pop("lm_head.weight", None)
        if has_router(self.model):
            # transformers 5 holds a layer's experts fused ([E, 2I, H] gate_up_proj, [E, H, I]
            # down_proj); checkpoints, SGLang and vLLM name them per expert (experts.{e}.gate_proj...):
            # save_pretrained's own reverse conversion gives those names
            from transformers.core_model_loading import revert_weight_conversion

            state = revert_weight_conversion(self.model, state)
        return state

    def weight_specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape))
            for name, t in self._export_state().items()
        ]

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._export_state().items()

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str) -> None:
        assert self.model is not None and self.optimizer is not None
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        model_state = self.model.state_dict()
        state = {
            # LoRA: the adapters only (the frozen base is model.path's)
            "model": lora_adapters.adapter_state(model_state) if self.lora.enabled else model_state,
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(),
        }
        tmp = folder / "trainer.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(folder / "trainer.pt")

    def load_checkpoint(self, path: str) -> None:
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        state = torch.load(Path(path) / "trainer.pt", weights_only=False)
        loaded = self.model.load_state_dict(state["model"], strict=not self.lora.enabled)
        missing = [k for k in loaded.missing_keys if lora_adapters.is_adapter_key(k)]
        if loaded.unexpected_keys or missing:
            raise ValueError(
                f"{path}: the checkpoint's adapters do not match model.lora (missing {missing[:3]}, "
                f"unexpected {loaded.unexpected_keys[:3]}): resume with the run's own model.lora"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])

    def save_hf(self, path: str) -> None:
        """A plain HF model (LoRA: the adapters merged in)."""
        assert self.model is not None
        folder = Path(path)
        state = self._export_state() if self.lora.enabled else None
        self.model.save_pretrained(str(folder), state_dict=state, safe_serialization=True)
        for name in _TOKENIZER_FILES:
            src = Path(self.model_path) / name
            if src.exists():
                shutil.copyfile(src, folder / name)  # the run's umask, not the source's mode

    def save_adapter(self, path: str) -> None:
        """LoRA: the adapters alone, as a PEFT directory naming model.path as its base."""
        assert self.model is not None and self.lora.enabled, "save_adapter needs model.lora.rank > 0"
        adapters = lora_adapters.adapter_state(self.model.state_dict())
        lora_adapters.write_adapter_dir(path, adapters, self.lora, str(Path(self.model_path).resolve()))
