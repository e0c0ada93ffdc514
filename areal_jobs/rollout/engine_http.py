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
    """Two aiohttp sessions to one server, opened on first use: pooled connections for the many
    generate calls, a fresh connection for each control call (pause, resume, weight update stages,
    health). A pooled connection that the server closed while it sat idle fails the call that
    reuses it; for a generate call the controller re-sends the request, but a failed stage of a
    weight update ends the run. A new local TCP connection costs about a millisecond, and an update
    makes a handful of control calls per server."""

    def __init__(
        self, name: str, url: str, api_key: str, *, generate_timeout_s: float, call_timeout_s: float
    ) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.generate_timeout = aiohttp.ClientTimeout(total=generate_timeout_s)
        self.call_timeout = aiohttp.ClientTimeout(total=call_timeout_s)
        self._pooled: aiohttp.ClientSession | None = None
        self._control: aiohttp.ClientSession | None = None

    def session(self, *, pooled: bool = False) -> aiohttp.ClientSession:
        if pooled:
            if self._pooled is None:
                # limit=0: concurrency is bounded by the controller, not the pool. A short
                # keep-alive: servers close idle connections after ~5 s
                connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
                self._pooled = aiohttp.ClientSession(connector=connector)
            return self._pooled
        if self._control is None:
            self._control = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        return self._control

    async def request(
        self,
        method: str,
        endpoint: str,
        body: dict[str, Any] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
        params: dict[str, str] | None = None,
        *,
        pooled: bool = False,
    ) -> Any:
        """JSON (or plain text) of a 200 answer; anything else raises ServerCallError."""
        try:
            async with self.session(pooled=pooled).request(
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
        """A control call: its own connection, `call_timeout_s` unless given."""
        return await self.request("POST", endpoint, body, timeout)

    async def generate(self, endpoint: str, body: dict[str, Any]) -> Any:
        """A generate call: pooled connections, `generate_timeout_s`."""
        return await self.request("POST", endpoint, body, self.generate_timeout, pooled=True)

    async def healthy(self) -> bool:
        try:
            async with self.session().get(
                self.url + "/health", headers=self.headers, timeout=self.call_timeout
            ) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def close(self) -> None:
        for session in (self._pooled, self._control):
            if session is not None:
                await session.close()
        self._pooled = self._control = None


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
