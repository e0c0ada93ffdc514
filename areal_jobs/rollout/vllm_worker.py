"""vLLM worker extension: join the trainer's weight-broadcast group and load buckets in place.

Runs inside the vLLM server's worker processes (`--worker-extension-cls
areal_jobs.rollout.vllm_worker.BroadcastWeightReceiver`), so it imports only the standard library,
torch, vLLM and areal_jobs.weights' torch-only receiver: the vLLM venv has nothing else of ours. vLLM mixes this class into its worker
class; the client calls the methods on every worker through `POST /collective_rpc` with one JSON
string argument each (vLLM passes only strings through that route).

The group is formed exactly as SGLang forms it (weights/broadcast.py is the sender for both): a TCP
store hosted by the sender (rank 0), prefixed by the group name; this server's workers take ranks
rank_offset .. rank_offset + tp - 1. A bucket is one flat uint8 broadcast of one dtype's tensors
back to back, with Hugging Face names.

Loading: vLLM's own in-place reload machinery, split across the handshake. begin ->
`initialize_layerwise_reload` (layers go back to their checkpoint layout), each bucket ->
`model.load_weights` (a layer is re-processed as soon as all its weights arrived: on CPU that
re-packs the oneDNN/sgl GEMM weights, which a plain `param.copy_` would miss), end ->
`finalize_layerwise_reload` plus the caches derived from weights. A tied lm_head is never sent
(the checkpoint has none); it shares the embedding and is re-packed with it.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("areal_jobs.rollout.vllm_worker")


class BroadcastWeightReceiver:
    """Methods vLLM adds to its worker class. Names start with `areal_` (no clash with vLLM's)."""

    def _areal_state(self) -> dict[str, Any]:
        # an extension cannot define __init__ (vLLM's worker constructs itself): state lives here
        state = getattr(self, "_areal_receiver_state", None)
        if state is None:
            state = {"groups": {}, "version": "0", "loading": False}
            self._areal_receiver_state = state
        return state

    def areal_init_group(self, payload: str) -> None:
        """Join group `group_name` as rank rank_offset + this worker's rank (the sender is rank 0)."""
        from torch.distributed.distributed_c10d import (
            Backend,
            PrefixStore,
            _new_process_group_helper,
            rendezvous,
        )

        args = json.loads(payload)
        name = args["group_name"]
        rank = int(args["rank_offset"]) + int(getattr(self, "rank", 0))
        world = int(args["world_size"])
        timeout = timedelta(seconds=float(args["group_timeout_s"]))
        t0 = time.monotonic()
        store, _, _ = next(
            rendezvous(f"tcp://{args['master_address']}:{args['master_port']}", rank, world, timeout=timeout)
        )
        store.set_timeout(timeout)
        group, _ = _new_process_group_helper(
            world,
            rank,
            [],
            Backend(args["backend"]),
            PrefixStore(name, store),
            group_name=name,
            timeout=timeout,
        )
        self._areal_state()["groups"][name] = group
        logger.info("joined weight group %s as rank %d/%d in %.2fs", name, rank, world, time.monotonic() - t0)

    def areal_destroy_group(self, payload: str) -> None:
        name = json.loads(payload)["group_name"]
        group = self._areal_state()["groups"].pop(name, None)
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except (
                RuntimeError,
                ValueError,
                KeyError,
            ) as exc:  # not registered by the helper: it goes with us
                logger.debug("destroying group %s: %s", name, exc)

    def areal_begin_update(self, payload: str = "{}") -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        state = self._areal_state()
        if state["loading"]:
            raise RuntimeError("begin_weight_update while an update is open: end it first")
        # "ParallelLMHead / RotaryEmbedding: Failed to load weights" on every update is expected (a
        # tied head and the rotary buffers are not in a checkpoint): the head is re-packed at the end
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        initialize_layerwise_reload(self.model_runner.get_model())
        state["loading"] = True

    def areal_receive_bucket(self, payload: str) -> int:
        """Receive one bucket from rank 0 of `group_name` and load it; returns the bytes received."""
        args = json.loads(payload)
        state = self._areal_state()
        if not state["loading"]:
            raise RuntimeError("a bucket arrived outside begin_weight_update ... end_weight_update")
        group = state["groups"].get(args["group_name"])
        if group is None:
            raise RuntimeError(f"no weight group {args['group_name']!r} on this worker: form it first")
        dtypes = [getattr(torch, d) for d in args["dtypes"]]
        shapes = [tuple(int(x) for x in s) for s in args["shapes"]]
        sizes = [
            _numel(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in zip(shapes, dtypes)
        ]
        device = _receive_device(self)
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(flat, group=group, group_src=0)
        weights, offset = [], 0
        for name, dtype, shape, size in zip(args["names"], dtypes, shapes, sizes):
            weights.append((name, flat[offset : offset + size].view(dtype).view(shape)))
            offset += size
        self.model_runner.get_model().load_weights(weights=weights)
        return int(flat.numel())

    def areal_receive_encoded(self, payload: str) -> dict[str, float]:
        """weight_sync.sync=delta: one encoded bucket (a delta or a full copy) from rank 0 of
        `group_name`, applied onto this worker's copy and verified (weights/receiver.py), then
        every tensor of the bucket loaded from that copy: the layer-wise reload processes a layer
        only once all its tensors arrived. Returns the worker's own timings."""
        from areal_jobs.weights.receiver import BaseCopy, parse_specs, receive_bucket

        args = json.loads(payload)
        state = self._areal_state()
        if not state["loading"]:
            raise RuntimeError("a bucket arrived outside begin_weight_update ... end_weight_update")
        group = state["groups"].get(args["group_name"])
        if group is None:
            raise RuntimeError(f"no weight group {args['group_name']!r} on this worker: form it first")
        copy = state.setdefault("copy", BaseCopy())
        model = self.model_runner.get_model()
        specs = parse_specs(args["names"], args["dtypes"], args["shapes"])
        return receive_bucket(
            copy,
            group,
            specs,
            _receive_device(self),
            lambda named: model.load_weights(weights=named),
            load_all=True,
        )

    def areal_load_from_disk(self, payload: str) -> None:
        """Disk fallback: every *.safetensors file of a Hugging Face directory, loaded the same
        way as broadcast buckets (end with areal_end_update)."""
        from pathlib import Path

        from safetensors.torch import load_file

        files = sorted(Path(json.loads(payload)["path"]).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {json.loads(payload)['path']}")
        if not self._areal_state()[
            "loading"
        ]:  # a repeat (rollout/control_calls.py) loads into the open reload
            self.areal_begin_update()
        model = self.model_runner.get_model()
        for file in files:
            model.load_weights(weights=list(load_file(str(file)).items()))

    def areal_end_update(self, payload: str) -> None:
        """Finish the in-place reload (layers not fully received keep their old weights)."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        state = self._areal_state()
        if state["loading"]:
            model = self.model_runner.get_model()
            finalize_layerwise_reload(model, self.model_runner.model_config)
            _repack_embedding_heads(model)
            _repack_moe_experts(model)
            state["loading"] = False
            for reset in ("reset_encoder_cache", "reset_mm_cache"):
                if hasattr(self.model_runner, reset):
                    getattr(self.model_runner, reset)()
        state["version"] = json.loads(payload)["version"]

    def areal_enable_routes(self, payload: str = "{}") -> bool:
        """trainer.routing_replay=rollout: record every request's experts from now on
        (vllm_routes.py; idempotent). True once recording."""
        state = self._areal_state()
        if "routes" not in state:
            from areal_jobs.rollout.vllm_routes import install

            state["routes"] = install(self)
        return True

    def areal_take_routes(self, payload: str) -> dict | None:
        """The recorded experts of request `rid` (then forgotten), or None."""
        recorder = self._areal_state().get("routes")
        return None if recorder is None else recorder.take(json.loads(payload)["rid"])


def _repack_embedding_heads(model: torch.nn.Module) -> None:
    """CPU only: pack the GEMM of every embedding-shaped layer (embedding, LM head) again from the
    weight it holds now. With tied embeddings vLLM's lm_head is its own module sharing the
    embedding's parameter: the reload unties them (meta tensors), loads nothing into the head
    (the checkpoint has no lm_head.weight) and hands it back its old parameter, now holding the
    new values, without re-packing it: the head kept computing with the old weights."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(module, VocabParallelEmbedding)
            and weight is not None
            and weight.ndim == 2
            and weight.numel()
        ):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def _repack_moe_experts(model: torch.nn.Module) -> None:
    """CPU only: pack every MoE layer's expert weights again into the CPU kernel's grouped-GEMM
    layout. vLLM 0.32 prepacks them in place once (CPUUnquantizedExperts.process_weights_after_loading);
    on a reload its _setup_kernel copies the new, unpacked weights into those parameters and skips
    the prepack (`is_weight_update`), so the kernel read checkpoint-layout weights as packed ones:
    after the first update the tiny MoE's log-probs were off by 8.8 nats per token. Every update
    carries every tensor (full and delta alike: receive_bucket load_all), so every MoE layer holds
    unpacked weights here."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _receive_device(worker) -> torch.device:
    device = getattr(worker, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        return device  # NCCL receives into GPU memory
    return torch.device("cpu")
