"""What the trainer holds per rank, in bytes: parameters (all, and the trainable ones) and the
optimiser's state. Logged with every step (memory/*), so full fine-tuning and LoRA
(model.lora.rank) compare by measurement, not by formula. FSDP: this rank's shards."""

from __future__ import annotations

import torch


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank
    return local.numel() * local.element_size()


def trainer_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    params = list(model.parameters())  # shared (tied) parameters once
    optim = sum(
        _local_bytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    )
    return {
        "memory/param_bytes": float(sum(_local_bytes(p) for p in params)),
        "memory/trainable_param_bytes": float(sum(_local_bytes(p) for p in params if p.requires_grad)),
        "memory/optimizer_state_bytes": float(optim),
    }
