"""The one module that speaks SGLang's HTTP API (token ids in, token ids and log-probs out).

Implements api.RolloutEngineClient; the transport (API key, timeouts, ServerCallError naming the
server and endpoint) is engine_http.EngineHTTP, shared with the vLLM client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import aiohttp

from areal_jobs.api import FinishReason, GenerateRequest, GenerateResponse, Health, TensorSpec
from areal_jobs.rollout import sglang_delta
from areal_jobs.rollout.engine_http import (
    EngineHTTP,
    ServerCallError,
    parse_weight_version,
    require_success,
)
from areal_jobs.rollout.lora_adapters import AdapterSet
from areal_jobs.transport.retry import RetryPolicy

__all__ = ["SGLangClient", "ServerCallError", "parse_generate", "parse_weight_version"]

IDLE_WAIT_S = 30.0  # release_memory: how long a server may take to become idle
logger = logging.getLogger(__name__)


def parse_generate(payload: dict[str, Any]) -> GenerateResponse:
    """Pure: SGLang /generate JSON -> GenerateResponse (tested against recorded payloads)."""
    meta = payload.get("meta_info") or {}
    rows = meta.get("output_token_logprobs") or []
    output_ids = [int(i) for i in payload.get("output_ids") or []]
    if len(rows) != len(output_ids):
        raise ValueError(
            f"{len(output_ids)} output ids but {len(rows)} log-probs: ask with return_logprob=true"
        )
    logprobs = [float(row[0]) for row in rows]
    if any(int(row[1]) != tok for row, tok in zip(rows, output_ids)):
        raise ValueError("log-prob rows do not match output ids")
    reason = (meta.get("finish_reason") or {}).get("type")
    try:
        finish = FinishReason(reason)
    except ValueError:
        raise ValueError(f"unexpected finish_reason {meta.get('finish_reason')!r}") from None
    return GenerateResponse(output_ids, logprobs, finish, parse_weight_version(meta.get("weight_version")))


def _timeout(seconds: float | None) -> aiohttp.ClientTimeout | None:
    return None if seconds is None else aiohttp.ClientTimeout(total=seconds)


class SGLangClient:
    """One SGLang server. Implements api.RolloutEngineClient."""

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
    ):
        self.name = name
        self.tp_size = tp_size  # one serialized payload per TP rank (update_weights_from_tensor)
        self.url = url.rstrip("/")
        self._http = EngineHTTP(
            name, url, api_key, generate_timeout_s=generate_timeout_s, call_timeout_s=call_timeout_s,
            retry=retry, load_deadline_s=load_deadline_s,
        )  # fmt: skip
        self.adapters = AdapterSet()  # model.lora.ship=adapter: lora_adapters.py

    async def _post(self, endpoint: str, body: dict[str, Any], timeout=None) -> Any:
        return await self._http.post(endpoint, body, timeout)

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        sampling: dict[str, Any] = {
            "max_new_tokens": request.max_new_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": -1,
            # keep EOS in output_ids: the policy must learn to stop, so the stop token is trained
            "no_stop_trim": True,
        }
        if request.seed is not None:
            sampling["sampling_seed"] = request.seed
        if request.stop_token_ids:
            sampling["stop_token_ids"] = list(request.stop_token_ids)
        if request.stop:
            sampling["stop"] = list(request.stop)
        body = {
            "input_ids": request.input_ids,
            "sampling_params": sampling,
            "return_logprob": True,
            "rid": request.rid,
        }
        if request.cache_salt:
            body["cache_salt"] = request.cache_salt
        adapter = self.adapters.acquire()
        try:
            if adapter is not None:
                body["lora_path"] = adapter[0]  # a loaded adapter's name
            payload = await self._http.generate("/generate", body)
        finally:
            self.adapters.release(adapter)
        try:
            response = parse_generate(payload)
        except ValueError as exc:
            raise ServerCallError(self.name, "/generate", str(exc)) from None
        if adapter is not None:  # every token came from this adapter: its version, exactly
            response = dataclasses.replace(response, weight_version=adapter[1])
        return response

    async def pause(self, mode: str) -> None:
        await self._post("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._post("/continue_generation", {})

    async def release_memory(self) -> None:
        # every tag (weights, KV cache, CUDA graphs); freed for real only with --enable-memory-saver
        # (GPU); on CPU it flushes the cache and keeps the tensors.
        # SGLang asserts that the server is idle, and its scheduler dies if not: a request that has
        # just returned can still sit in the running batch for a moment (seen under load: the
        # server went down). /flush_cache is refused (HTTP 400) in exactly that state, so it is
        # the idle check, retried until it succeeds
        deadline = time.monotonic() + IDLE_WAIT_S
        while True:
            try:
                await self._post("/flush_cache", {})
                break
            except ServerCallError as exc:
                if exc.status != 400 or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        await self._post("/release_memory_occupation", {})

    async def resume_memory(self) -> None:
        await self._post("/resume_memory_occupation", {})

    async def healthy(self) -> bool:
        return await self._http.healthy()

    async def health(self) -> Health:
        return await self._http.health()

    async def abort_all(self) -> None:
        await self._post("/abort_request", {"abort_all": True})

    # ------------------------------------------------------------------ weight updates

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
        """`timeout_s`: the stage's timeout (a rendezvous with the trainer), else call_timeout_s."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        result = await self._post("/init_weights_update_group", body, _timeout(timeout_s))
        require_success(self.name, "/init_weights_update_group", result)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._post("/destroy_weights_update_group", {"group_name": group_name})

    async def begin_weight_update(self) -> None:
        await self._post("/begin_weight_update", {})

    async def update_weights_from_distributed(
        self,
        tensors: tuple[TensorSpec, ...],
        group_name: str,
        version: int,
        *,
        timeout_s: float | None = None,
    ) -> None:
        body = {
            "names": [t.name for t in tensors],
            "dtypes": [t.dtype for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": group_name,
            "weight_version": str(version),
            "load_format": "flattened_bucket",
            "flush_cache": False,  # flushed once after the last bucket, in end_weight_update
        }
        result = await self._post("/update_weights_from_distributed", body, _timeout(timeout_s))
        require_success(self.name, "/update_weights_from_distributed", result)

    async def receive_encoded_bucket(
        self,
        tensors: tuple[TensorSpec, ...],
        group_name: str,
        version: int,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """weight_sync.sync=delta: our custom weight loader receives, applies and verifies the
        bucket inside the scheduler (sglang_delta.py); a refusal is settled with the sender there."""
        body = sglang_delta.request_body(
            [t.name for t in tensors], [t.dtype for t in tensors], [list(t.shape) for t in tensors],
            group_name, version, self.tp_size,
        )  # fmt: skip
        result = await self._post("/update_weights_from_tensor", body, _timeout(timeout_s))
        require_success(self.name, "/update_weights_from_tensor", result)

    async def end_weight_update(self) -> None:
        await self._post("/end_weight_update", {})

    async def flush_cache(self) -> None:
        await self._post("/flush_cache", {})

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        result = await self._post(
            "/update_weights_from_disk", {"model_path": model_path, "weight_version": str(version)}
        )
        require_success(self.name, "/update_weights_from_disk", result)

    async def load_lora_adapter(self, path: str, version: int) -> None:
        name = self.adapters.new_name(version)
        result = await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": path})
        require_success(self.name, "/load_lora_adapter", result)
        self.adapters.loaded_as(name, version)
        for old in self.adapters.idle():  # no request of ours uses it: SGLang unloads at once
            try:
                result = await self._post("/unload_lora_adapter", {"lora_name": old})
                require_success(self.name, "/unload_lora_adapter", result)
            except ServerCallError as exc:  # tidying only: tried again at the next update
                logger.warning("%s", exc)
                continue
            self.adapters.unloaded(old)

    async def weight_version(self) -> int:
        if self.adapters.current is not None:
            return self.adapters.current[1]
        info = await self._http.control("/model_info", method="GET")
        return parse_weight_version((info or {}).get("weight_version"))

    async def close(self) -> None:
        await self._http.close()
