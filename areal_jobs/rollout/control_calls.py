"""Every HTTP control call the controller makes to a rollout server, classified: may it be repeated?

A call that timed out may still be waiting in the server's queue, and run later: its repeat then
runs twice, and the first copy may run after calls sent since. So:

`Repeat.safe`: sent again after a timeout, because a late copy is harmless whenever it runs (a
read, a cache flush, tearing down a group that is gone).
`Repeat.wait`: a state change that a later call undoes (pause / resume, begin / end of an update,
a version label): a stale pause landing after its resume would leave the server paused for good
(seen in the starvation test). Never sent twice while the first may be pending: the controller
waits for that one request, up to the deadline (transport/retry.wait_patiently), and sends it
again only when it provably never reached the server (a failed connection, a 502/503/504). If
the server refuses such a re-send because the first did the work after all (SGLang: "already
open"), `done_marker` recognises that as success.
`Repeat.once`: never repeated alone, because the call is one half of a collective with the trainer
(a group rendezvous, a bucket broadcast) or would create a second sample; the operation around it
is repeated under its own identity instead: the weight update by its version (UpdateRetry, fresh
group names), a generation by the controller's continuation of the partial sample under a new
request id.

docs/faults.md ("Control calls") prints this table with the other boundaries' calls; a unit test
keeps the two and the clients' endpoints in step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Repeat(enum.Enum):
    safe = "safe"
    wait = "wait"
    once = "once"


@dataclass(frozen=True)
class ControlCall:
    endpoint: str  # the route on the server (both engines' routes are listed)
    repeat: Repeat
    why: str  # why it is safe to repeat, or what is repeated instead
    # wait: a refusal of a re-send whose text contains this means the first attempt did the work
    done_marker: str = ""
    load: bool = False  # reads weights from files: repeated until control.load_deadline_s


_UPDATE_AGAIN = "the whole update is sent again under the same version (UpdateRetry, fresh group names)"

CONTROL_CALLS: tuple[ControlCall, ...] = (
    ControlCall("/generate", Repeat.once, "a repeat is a second sample: the controller continues the partial sample on any server under a new request id"),
    ControlCall("/inference/v1/generate", Repeat.once, "as /generate (vLLM)"),
    ControlCall("/pause_generation", Repeat.wait, "sets the paused state; a late copy after the resume would keep the server paused"),
    ControlCall("/pause", Repeat.wait, "as /pause_generation (vLLM)"),
    ControlCall("/continue_generation", Repeat.wait, "clears the paused state; a late copy during the next update would let generation run on half-loaded weights"),
    ControlCall("/resume", Repeat.wait, "as /continue_generation (vLLM)"),
    ControlCall("/abort_request", Repeat.wait, "aborts whatever runs: a late copy would abort requests sent after it"),
    ControlCall("/abort_requests", Repeat.wait, "as /abort_request (vLLM)"),
    ControlCall("/flush_cache", Repeat.safe, "an empty cache stays empty (HTTP 400 while busy: retried until idle)"),
    ControlCall("/reset_prefix_cache", Repeat.safe, "as /flush_cache (vLLM)"),
    ControlCall("/health", Repeat.safe, "a probe; the health loop marks a server down only after control.health_grace_s of failed probes"),
    ControlCall("/model_info", Repeat.safe, "reads the weight version"),
    ControlCall("/weight_info", Repeat.safe, "reads the weight version (vLLM)"),
    ControlCall("/update_weight_version", Repeat.wait, "sets the version label (vLLM): a late copy would label newer weights with an older version"),
    ControlCall("/init_weights_update_group", Repeat.once, f"a rendezvous with the trainer's broadcast group: {_UPDATE_AGAIN}"),
    ControlCall("/destroy_weights_update_group", Repeat.safe, "tearing down a group that is gone is a no-op (best effort)"),
    ControlCall("/begin_weight_update", Repeat.wait, "opens the update session: a late copy after its end would leave one open", "already open"),
    ControlCall("/update_weights_from_distributed", Repeat.once, f"one bucket of the trainer's broadcast (a collective): {_UPDATE_AGAIN}"),
    ControlCall("/update_weights_from_tensor", Repeat.once, f"weight_sync.sync=delta: one encoded bucket through our custom weight loader (collectives with the trainer): {_UPDATE_AGAIN}"),
    ControlCall("/end_weight_update", Repeat.wait, "closes the session: a late copy would close the next update's", "no weight-update session is open"),
    ControlCall("/update_weights_from_disk", Repeat.wait, "a late copy would load this version's files over a newer one", load=True),
    ControlCall("/load_lora_adapter", Repeat.once, "a second load under the same name is refused: the next update loads the adapter under a new name"),
    ControlCall("/v1/load_lora_adapter", Repeat.once, "as /load_lora_adapter (vLLM)"),
    ControlCall("/unload_lora_adapter", Repeat.once, "tidying only: tried again at the next update"),
    ControlCall("/v1/unload_lora_adapter", Repeat.once, "as /unload_lora_adapter (vLLM)"),
    ControlCall("/release_memory_occupation", Repeat.once, "GPU memory hand-over of the colocated schedule; a failure marks the server down"),
    ControlCall("/resume_memory_occupation", Repeat.once, "as /release_memory_occupation"),
    ControlCall("/sleep", Repeat.once, "as /release_memory_occupation (vLLM)"),
    ControlCall("/wake_up", Repeat.once, "as /resume_memory_occupation (vLLM)"),
    ControlCall("/freeze_gc", Repeat.safe, "start-up optimisation, once after the server is healthy"),
    # reward-model servers (reward.model.*; rollout/reward_client.py): both only read
    ControlCall("/classify", Repeat.safe, "reward model: scores a batch of answers and changes nothing; a late copy's answer is dropped"),
    ControlCall("/generate#judge", Repeat.safe, "a judge's greedy verdict (temperature 0) is a read, not a training sample: a repeat goes out under a fresh request id and a late answer is dropped"),
    # vLLM's weight-update stages run methods of our worker extension (rollout/vllm_worker.py)
    # through one route, /collective_rpc; each method is classified on its own
    ControlCall("/collective_rpc#areal_init_group", Repeat.once, f"vLLM group rendezvous: {_UPDATE_AGAIN}"),
    ControlCall("/collective_rpc#areal_destroy_group", Repeat.safe, "vLLM: a group that is gone stays gone"),
    ControlCall("/collective_rpc#areal_begin_update", Repeat.wait, "vLLM: as /begin_weight_update", "while an update is open"),
    ControlCall("/collective_rpc#areal_receive_bucket", Repeat.once, f"vLLM: one bucket of the broadcast: {_UPDATE_AGAIN}"),
    ControlCall("/collective_rpc#areal_receive_encoded", Repeat.once, f"vLLM: one encoded bucket (weight_sync.sync=delta): {_UPDATE_AGAIN}"),
    ControlCall("/collective_rpc#areal_end_update", Repeat.wait, "vLLM: as /end_weight_update (it also sets the version label)"),
    ControlCall("/collective_rpc#areal_load_from_disk", Repeat.wait, "vLLM: as /update_weights_from_disk", load=True),
    # trainer.routing_replay=rollout: the workers record each request's experts (rollout/vllm_routes.py)
    ControlCall("/collective_rpc#areal_enable_routes", Repeat.safe, "vLLM routing replay: starts recording; a second copy finds it recording and does nothing"),
    ControlCall("/collective_rpc#areal_take_routes", Repeat.safe, "vLLM routing replay: reads and forgets one finished request's experts; a late copy finds none, and a lost answer leaves that sample without routes (the trainer routes it itself)"),
)  # fmt: skip

BY_ENDPOINT: dict[str, ControlCall] = {c.endpoint: c for c in CONTROL_CALLS}


def control_call(endpoint: str) -> ControlCall:
    try:
        return BY_ENDPOINT[endpoint]
    except KeyError:
        raise KeyError(
            f"{endpoint} is not in rollout/control_calls.CONTROL_CALLS: classify it (safe, by_state, once)"
        ) from None
