"""Rank 0's TrainBatch to every trainer rank (Megatron and FSDP backends), without pickle.

The batch travels as the bytes of transport/batch_codec.py in a uint8 tensor: its length first,
then the bytes, over the default process group (gloo on CPU, NCCL on GPU: `device`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from areal_jobs.trainer.intake.batch import TrainBatch
from areal_jobs.transport.batch_codec import decode_train_batch, encode_train_batch


def broadcast_train_batch(batch: TrainBatch | None, device: torch.device | None = None) -> TrainBatch:
    """Collective: every rank calls it; global rank 0 passes the batch, the others None."""
    if dist.get_rank() == 0:
        assert batch is not None, "global rank 0 must pass the batch"
        payload = torch.frombuffer(bytearray(encode_train_batch(batch)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if dist.get_rank() == 0:
        payload = payload.to(device) if device is not None else payload
    else:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=0)
    return batch if dist.get_rank() == 0 else decode_train_batch(payload.cpu().numpy().tobytes())
