"""A trainer rank's share of a GPU it shares with rollout servers (the planner's division:
launch/planning/fit/gpu_shares.py, written into trainer.gpu_memory_fraction).

`limit` caps this process's CUDA caching allocator at its share, so the trainer fails in its own
process (an OOM naming the cap) instead of taking the servers' memory. With the colocated schedule
(rollout.release_memory_while_training) the servers free their memory while the trainer steps and
take it back for the weight update, so every rank hands its cached blocks back to the driver after
each step (`after_step`): what the caching allocator keeps would otherwise stay out of the servers'
reach. GPU only; on CPU both are no-ops (nothing to verify there).
"""

from __future__ import annotations

import logging

from areal_jobs.config import JobConfig

logger = logging.getLogger(__name__)

_give_back = False


def limit(cfg: JobConfig) -> None:
    """At start-up, before the model is on the GPU."""
    global _give_back
    import torch

    if not torch.cuda.is_available():
        return
    fraction = cfg.trainer.gpu_memory_fraction
    if fraction:
        torch.cuda.set_per_process_memory_fraction(fraction)
        logger.info("this rank may use %.3f of its GPU's memory (shared with rollout servers)", fraction)
    _give_back = cfg.rollout.release_memory_while_training


def after_step() -> None:
    """After each train step, on every rank: the servers are about to take their memory back."""
    if _give_back:
        import torch

        torch.cuda.empty_cache()
