"""The trainer ranks' default process group (Megatron and FSDP backends): joined from env://
as torchrun, srun or launch.local set it, or a private one-rank group for a lone process."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist


def join_default_group(backend: str, timeout_s: float, world_size: int, layout: str) -> None:
    """Join (once) and check that the world has `world_size` ranks. `layout` names the settings
    that decide `world_size` in the error messages (e.g. "trainer.dp_size=2")."""
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        elif world_size == 1:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
            dist.init_process_group(backend, init_method=address, rank=0, world_size=1, timeout=timeout)
        else:
            raise ValueError(
                f"{layout}: {world_size} processes: start them with torchrun, srun or launch.local "
                "so that RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set"
            )
    if dist.get_world_size() != world_size:
        raise ValueError(
            f"{dist.get_world_size()} trainer processes but {layout} makes {world_size}: "
            "change trainer.dp_size"
        )
