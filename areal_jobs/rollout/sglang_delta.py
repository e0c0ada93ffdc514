"""Encoded buckets (weight_sync.sync=delta) into a running SGLang server, through SGLang's own
extension point: a custom weight loader named by import path.

SGLang 0.5.23 calls a function listed in `--custom-weight-loader` when `/update_weights_from_tensor`
names it as `load_format`, with the model and the request's named tensors, inside its scheduler
process (the one that joined our broadcast group with `/init_weights_update_group`). SGLang's own
`/update_weights_from_distributed` only loads full named tensors, so the encoded bucket goes
through this route instead, and nothing of SGLang is patched:

  controller  POST /update_weights_from_tensor {load_format: LOADER, serialized_named_tensors:
              [one (header, empty tensor) pair per TP rank]}; the header is JSON: the group's name
              and the bucket's names, dtypes and shapes
  scheduler   `load_bucket(model, named_tensors)` finds the group by name, receives the bucket over
              it (weights/receiver.py: apply onto this rank's copy, verify, status to the sender) and
              loads what changed with the model's own `load_weights`

The request's tensors travel as SGLang's serialization (a pickle its scheduler reads with its own
restricted unpickler): the only such bytes we make, holding a string and an empty tensor, never
weights. An exception in a custom loader ends SGLang's scheduler, so a refusal is never one: it
goes back to the sender in the bucket's status exchange, which answers it with the whole bucket.
Only a whole bucket that fails its checksum too raises: that server cannot hold the weights, it
goes down, and the pool retries the update without it (docs/faults.md).

This module runs in SGLang's scheduler: standard library, torch and weights/ only.
"""

from __future__ import annotations

import base64
import json
import logging
import pickle
from typing import Any

# torch and the receiver are imported where used: the launcher imports LOADER from here
LOADER = "areal_jobs.rollout.sglang_delta.load_bucket"  # --custom-weight-loader and load_format
logger = logging.getLogger("areal_jobs.rollout.sglang_delta")

_COPY: Any = None  # this scheduler process's (TP rank's) receiver.BaseCopy of what it was last sent
_BROKEN: set[str] = set()  # groups whose collectives failed (the sender dropped them): not used again


def request_body(names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                 version: int, tp_size: int) -> dict:  # fmt: skip
    """The /update_weights_from_tensor body that makes every TP rank receive one encoded bucket."""
    header = json.dumps({"group_name": group_name, "names": names, "dtypes": dtypes, "shapes": shapes})
    import torch

    # SGLang's payload is one serialized list of (name, tensor) per TP rank; pickle protocol 4 of a
    # str and an empty CPU tensor needs only globals SGLang's SafeUnpickler allows
    one = base64.b64encode(pickle.dumps([(header, torch.empty(0))], protocol=4)).decode()
    return {
        "serialized_named_tensors": [one] * tp_size,
        "load_format": LOADER,
        "flush_cache": False,  # flushed once after the last bucket, in end_weight_update
        "weight_version": str(version),
    }


def load_bucket(model: Any, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's custom-loader entry point (between begin_weight_update and end_weight_update)."""
    from torch.distributed import distributed_c10d as c10d

    from areal_jobs.weights.receiver import (
        BaseCopy,
        BucketUnusable,
        group_device,
        parse_specs,
        receive_bucket,
    )

    global _COPY
    if _COPY is None:
        _COPY = BaseCopy()

    header = json.loads(named_tensors[0][0])
    name = header["group_name"]
    if name in _BROKEN:  # its update already broke off here: the controller retries with a new group
        logger.warning("skipping a bucket of broken weight group %s", name)
        return
    group = next((pg for pg, pg_name in c10d._world.pg_names.items() if pg_name == name), None)
    if group is None:
        raise RuntimeError(
            f"no weight group {name!r} in this SGLang scheduler: init_weights_update_group first"
        )
    specs = parse_specs(header["names"], header["dtypes"], header["shapes"])
    try:
        stats = receive_bucket(
            _COPY, group, specs, group_device(group), lambda named: model.load_weights(named), load_all=False
        )
    except BucketUnusable:
        raise  # this server cannot hold the weights: it stops, and leaves the pool
    except RuntimeError as exc:
        # a collective failed: the sender dropped the group (another server died, or the
        # trainer's side timed out). Raising would end this healthy scheduler too. The update does
        # not count: the controller ends an encoded update only on the trainer's word
        # (BroadcastDone), and sends the version again as a full copy over a new group; until
        # then nothing here counts as any version
        _BROKEN.add(name)
        _COPY.invalidate()
        logger.error("weight group %s broke off during a bucket: %s", name, exc)
        return
    logger.debug("encoded bucket of %d tensors: %s", len(specs), stats)
