"""HTTP to one rollout engine server, whichever engine it is: the API key, timeouts, repeats and
errors.

Every call carries the job's API key and has a timeout; a failed call raises `ServerCallError`
naming the server and the endpoint, so a stuck weight update says exactly where it stuck. Control
calls go through `control`, which repeats the ones that are safe to repeat (control_calls.py)
after a timeout or a transient answer (502/503/504, a dropped connection), and waits patiently
for the ones whose late twin could do harm (never sending them twice while one may be pending),
under the job's retry policy (transport/retry.py); a refused connection is never repeated: the
server is gone. The
engine clients (sglang_client.py, vllm_client.py) speak their engine's routes through this.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import time
from collections import defaultdict
from typing import Any

import aiohttp

from areal_jobs.api import Health
from areal_jobs.rollout.control_calls import Repeat, control_call
from areal_jobs.transport.retry import RetryPolicy, RoundTrips, call_with_retry, wait_patiently

TRANSIENT_STATUS = (502, 503, 504)  # a proxy or an overloaded server: worth another attempt


class ServerCallError(RuntimeError):
    """A call to a rollout server failed, timed out, or the server answered with an error."""

    def __init__(
        self,
        server: str,
        endpoint: str,
        detail: str,
        status: int = 0,
        *,
        refused: bool = False,
        connect_failed: bool = False,
    ) -> None:
        super().__init__(f"{endpoint} on server {server} failed: {detail}")
        self.server = server
        self.endpoint = endpoint
        self.status = status  # HTTP status; 0 = no answer (connection refused, timeout)
        self.refused = refused  # nothing listens: the server process is gone (or not yet up)
        self.connect_failed = connect_failed  # no connection was made: the request never left

    @property
    def is_client_error(self) -> bool:
        """4xx: the request was wrong (a bug or a bad key), not the server: do not fail over."""
        return 400 <= self.status < 500

    @property
    def undelivered(self) -> bool:
        """The server provably did not act on the request: the connection failed before it was
        sent (not refused: nobody listens), or a 502/503/504 answered it."""
        return self.status in TRANSIENT_STATUS or (self.connect_failed and not self.refused)

    @property
    def transient(self) -> bool:
        """Worth another attempt: no answer in time, a dropped connection, or a 502/503/504; not a
        refused connection (nobody listens) and not an answer that judged the request."""
        return (self.status == 0 and not self.refused) or self.status in TRANSIENT_STATUS


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
        self,
        name: str,
        url: str,
        api_key: str,
        *,
        generate_timeout_s: float,
        call_timeout_s: float,
        retry: RetryPolicy | None = None,
        load_deadline_s: float = 0.0,
    ) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.generate_timeout = aiohttp.ClientTimeout(total=generate_timeout_s)
        self.call_timeout = aiohttp.ClientTimeout(total=call_timeout_s)
        # repeats of safe control calls; None: every call is tried once (its first timeout is
        # call_timeout_s either way)
        self.retry = retry
        self.load_deadline_s = load_deadline_s  # weight loads from files: their own deadline
        self.round_trips: defaultdict[str, RoundTrips] = defaultdict(RoundTrips)  # per control call
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
        except aiohttp.ClientConnectorError as exc:
            refused = exc.os_error.errno == errno.ECONNREFUSED if exc.os_error else False
            raise ServerCallError(
                self.name, endpoint, f"{type(exc).__name__}: {exc}", refused=refused, connect_failed=True
            ) from None
        except aiohttp.ClientError as exc:
            raise ServerCallError(self.name, endpoint, f"{type(exc).__name__}: {exc}") from None

    async def control(
        self,
        call: str,
        body: dict[str, Any] | None = None,
        *,
        method: str = "POST",
        params: dict[str, str] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> Any:
        """A control call, repeated as control_calls.py classifies `call` (its route, or
        "route#method" for vLLM's collective RPCs). `timeout` overrides the first attempt's."""
        kind = control_call(call)
        endpoint = call.split("#", 1)[0]
        first = timeout or self.call_timeout
        if self.retry is None or kind.repeat is Repeat.once:
            return await self.request(method, endpoint, body, first, params)
        policy = self.retry
        if kind.load and self.load_deadline_s > policy.deadline_s:
            policy = dataclasses.replace(policy, deadline_s=self.load_deadline_s)
        if first.total and first.total != policy.first_timeout_s:  # e.g. a weight-update stage's
            policy = dataclasses.replace(
                policy,
                first_timeout_s=first.total,
                deadline_s=max(policy.deadline_s, first.total),
                max_timeout_s=max(policy.max_timeout_s, first.total),
            )
        what = f"{call} on server {self.name}"
        trips = self.round_trips[call]
        deadline_s = trips.deadline_s(policy.deadline_s)
        started = time.monotonic()
        attempts = 0

        async def attempt(timeout_s: float) -> Any:
            nonlocal attempts
            attempts += 1
            try:
                if kind.repeat is Repeat.safe:
                    return await self.request(
                        method, endpoint, body, aiohttp.ClientTimeout(total=timeout_s), params
                    )
                # Repeat.wait: one request for as long as the deadline allows, never a twin
                left = aiohttp.ClientTimeout(total=max(deadline_s - (time.monotonic() - started), timeout_s))
                return await wait_patiently(
                    what,
                    self.request(method, endpoint, body, left, params),
                    trips.timeout_s(policy.first_timeout_s),
                )
            except ServerCallError as exc:
                # a re-send refused with "already done": the attempt before it did the work
                if attempts > 1 and kind.done_marker and kind.done_marker in str(exc):
                    return None
                raise

        if kind.repeat is Repeat.safe:
            retriable = lambda exc: isinstance(exc, ServerCallError) and exc.transient  # noqa: E731
        else:  # sent again only when the server provably never acted on it
            retriable = lambda exc: isinstance(exc, ServerCallError) and exc.undelivered  # noqa: E731
        return await call_with_retry(what, attempt, policy, retriable, round_trips=trips)

    async def post(
        self, endpoint: str, body: dict[str, Any], timeout: aiohttp.ClientTimeout | None = None
    ) -> Any:
        """A control call: its own connection, `call_timeout_s` unless given, repeated where safe."""
        return await self.control(endpoint, body, timeout=timeout)

    async def generate(self, endpoint: str, body: dict[str, Any]) -> Any:
        """A generate call: pooled connections, `generate_timeout_s`."""
        return await self.request("POST", endpoint, body, self.generate_timeout, pooled=True)

    async def health(self) -> Health:
        """One probe of GET /health, within call_timeout_s."""
        try:
            async with self.session().get(
                self.url + "/health", headers=self.headers, timeout=self.call_timeout
            ) as r:
                return Health.up if r.status == 200 else Health.no_answer
        except aiohttp.ClientConnectorError as exc:
            refused = exc.os_error is not None and exc.os_error.errno == errno.ECONNREFUSED
            return Health.refused if refused else Health.no_answer
        except (TimeoutError, aiohttp.ClientError):
            return Health.no_answer

    async def healthy(self) -> bool:
        return await self.health() is Health.up

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
