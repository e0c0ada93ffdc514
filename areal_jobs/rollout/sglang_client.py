"""The one module that speaks SGLang's HTTP API (token ids in, token ids and log-probs out).

Every call carries the job's API key and has a timeout; a failed call raises `ServerCallError`
naming the server and the endpoint, so a stuck weight update says exactly where it stuck.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp

from areal_jobs.api import FinishReason, GenerateRequest, GenerateResponse, TensorSpec

logger = logging.getLogger(__name__)


class ServerCallError(RuntimeError):
    """A call to a rollout server failed, timed out, or the server answered with an error."""

    def __init__(self, server: str, endpoint: str, detail: str, status: int = 0) -> None:
        super().__init__(f"{endpoint} on server {server} failed: {detail}")
        self.server = server
        self.endpoint = endpoint
        self.status = status  # HTTP status; 0 = no answer (connection refused, timeout)

    @property
    def is_client_error(self) -> bool:
        """4xx: the request was wrong (a bug or a bad key), not the server: do not fail over."""
        return 400 <= self.status < 500


def parse_weight_version(raw: Any) -> int:
    """SGLang reports the version as a string; the server starts as "0" (or "default")."""
    if raw in (None, "default"):
        return 0
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ValueError(
            f"weight_version {raw!r} is not an integer; servers must start with --weight-version 0"
        ) from None


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


class SGLangClient:
    """One SGLang server. Implements api.RolloutBackendClient plus the weight-update calls."""

    def __init__(
        self, name: str, url: str, api_key: str, *, generate_timeout_s: float, call_timeout_s: float
    ):
        self.name = name
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._generate_timeout = aiohttp.ClientTimeout(total=generate_timeout_s)
        self._call_timeout = aiohttp.ClientTimeout(total=call_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def _post(
        self, endpoint: str, body: dict[str, Any], timeout: aiohttp.ClientTimeout | None = None
    ) -> Any:
        self._ensure_session()
        try:
            async with self._session.post(
                self.url + endpoint, json=body, headers=self._headers, timeout=timeout or self._call_timeout
            ) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise ServerCallError(
                        self.name, endpoint, f"HTTP {resp.status}: {text[:300]}", resp.status
                    )
                return _json_or_text(text)
        except TimeoutError:
            raise ServerCallError(self.name, endpoint, "timed out") from None
        except aiohttp.ClientError as exc:
            raise ServerCallError(self.name, endpoint, f"{type(exc).__name__}: {exc}") from None

    def _ensure_session(self) -> None:
        if self._session is None:
            # limit=0: concurrency is bounded by the controller, not the pool. A short keep-alive:
            # the server closes idle connections after 5 s, and reusing one it closed fails the call
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
            self._session = aiohttp.ClientSession(connector=connector)

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
        body = {
            "input_ids": request.input_ids,
            "sampling_params": sampling,
            "return_logprob": True,
            "rid": request.rid,
        }
        payload = await self._post("/generate", body, self._generate_timeout)
        try:
            return parse_generate(payload)
        except ValueError as exc:
            raise ServerCallError(self.name, "/generate", str(exc)) from None

    async def pause(self, mode: str) -> None:
        await self._post("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._post("/continue_generation", {})

    async def healthy(self) -> bool:
        self._ensure_session()
        try:
            async with self._session.get(
                self.url + "/health", headers=self._headers, timeout=self._call_timeout
            ) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

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
    ) -> None:
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        result = await self._post("/init_weights_update_group", body)
        _require_success(self.name, "/init_weights_update_group", result)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._post("/destroy_weights_update_group", {"group_name": group_name})

    async def begin_weight_update(self) -> None:
        await self._post("/begin_weight_update", {})

    async def update_weights_from_distributed(
        self, tensors: tuple[TensorSpec, ...], group_name: str, version: int
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
        result = await self._post("/update_weights_from_distributed", body)
        _require_success(self.name, "/update_weights_from_distributed", result)

    async def end_weight_update(self) -> None:
        await self._post("/end_weight_update", {})

    async def flush_cache(self) -> None:
        await self._post("/flush_cache", {})

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        result = await self._post(
            "/update_weights_from_disk", {"model_path": model_path, "weight_version": str(version)}
        )
        _require_success(self.name, "/update_weights_from_disk", result)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _json_or_text(text: str) -> Any:
    """Most endpoints answer JSON; a few (flush_cache) answer plain text."""
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _require_success(server: str, endpoint: str, result: Any) -> None:
    if isinstance(result, dict) and result.get("success") is False:
        raise ServerCallError(server, endpoint, str(result.get("message", result))[:300])
