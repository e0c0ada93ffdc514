"""HTTP to one rollout engine server, whichever engine it is: the API key, timeouts and errors.

Every call carries the job's API key and has a timeout; a failed call raises `ServerCallError`
naming the server and the endpoint, so a stuck weight update says exactly where it stuck. The
engine clients (sglang_client.py, vllm_client.py) speak their engine's routes through this.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp


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
    """Engines report the version as a string; a server starts as "0" (or "default")."""
    if raw in (None, "default"):
        return 0
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ValueError(
            f"weight_version {raw!r} is not an integer; servers must start with --weight-version 0"
        ) from None


class EngineHTTP:
    """One aiohttp session to one server, opened on first use."""

    def __init__(
        self, name: str, url: str, api_key: str, *, generate_timeout_s: float, call_timeout_s: float
    ) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.generate_timeout = aiohttp.ClientTimeout(total=generate_timeout_s)
        self.call_timeout = aiohttp.ClientTimeout(total=call_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # limit=0: concurrency is bounded by the controller, not the pool. A short keep-alive:
            # servers close idle connections after ~5 s, and reusing one they closed fails the call
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def request(
        self,
        method: str,
        endpoint: str,
        body: dict[str, Any] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        """JSON (or plain text) of a 200 answer; anything else raises ServerCallError."""
        try:
            async with self.session().request(
                method,
                self.url + endpoint,
                json=body,
                params=params,
                headers=self.headers,
                timeout=timeout or self.call_timeout,
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

    async def post(
        self, endpoint: str, body: dict[str, Any], timeout: aiohttp.ClientTimeout | None = None
    ) -> Any:
        return await self.request("POST", endpoint, body, timeout)

    async def healthy(self) -> bool:
        try:
            async with self.session().get(
                self.url + "/health", headers=self.headers, timeout=self.call_timeout
            ) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _json_or_text(text: str) -> Any:
    """Most endpoints answer JSON; a few (SGLang's flush_cache) answer plain text."""
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def require_success(server: str, endpoint: str, result: Any) -> None:
    if isinstance(result, dict) and result.get("success") is False:
        raise ServerCallError(server, endpoint, str(result.get("message", result))[:300])
