"""How every backend cuts a batch into optimiser steps: token-balanced minibatches, which samples
the gradient pass gives proximal log-probs, each step's aggregation weights, the loss's per-token
inputs. The torch, FSDP2 and Megatron backends (and the ablation probe) share these, so a split
is the same whichever backend trains.
"""

from __future__ import annotations

import numpy as np
import torch

from areal_jobs.config import AlgoConfig
from areal_jobs.config.algo import ProxLogp
from areal_jobs.trainer.intake.batch import TrainSample
from areal_jobs.trainer.intake.packing import balanced_microbatches
from areal_jobs.trainer.objective.loss import token_weights


def loss_inputs(samples: list[TrainSample], agg_weights: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """Advantages, aggregation weights and sample index per token of one micro-batch, float32."""
    return {
        "advantages": torch.cat([torch.full((s.num_output_tokens,), s.advantage) for s in samples]),
        "token_weight": torch.cat([torch.as_tensor(a, dtype=torch.float32) for a in agg_weights]),
        "seq_index": torch.cat([torch.full((s.num_output_tokens,), i) for i, s in enumerate(samples)]),
    }


def split_minibatches(samples: list[TrainSample], algo: AlgoConfig) -> list[list[int]]:
    """Sample indices of each optimiser step: `algo.ppo_minibatches` minibatches balanced by
    output tokens (fewer when the batch has fewer samples). Every backend splits this way."""
    outputs = [s.num_output_tokens for s in samples]
    return balanced_microbatches(outputs, sum(outputs), min_count=min(algo.ppo_minibatches, len(samples)))


def prox_from_gradient_pass(algo: AlgoConfig, minibatches: list[list[int]]) -> set[int]:
    """Samples whose proximal log-probs the gradient pass supplies (prox_logp=current): those of
    the first minibatch, whose pass runs the pre-step weights. The others need the no-grad pass."""
    if algo.decoupled and algo.prox_logp is ProxLogp.current:
        return set(minibatches[0])
    return set()


def step_weights(
    samples: list[TrainSample], minibatch: list[int], algo: AlgoConfig, max_new_tokens: int
) -> dict[int, np.ndarray]:
    """Aggregation weights of one optimiser step's samples (loss.py token_weights), by index."""
    masks = [samples[i].mask() for i in minibatch]
    return dict(zip(minibatch, token_weights(masks, algo.loss_agg, max_new_tokens), strict=True))
