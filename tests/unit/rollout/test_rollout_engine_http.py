"""engine_http: control calls never reuse a connection the server may have closed.

A real aiohttp client against a raw asyncio server on 127.0.0.1 that keeps HTTP/1.1 connections
"alive" but closes each one, without answering, when a second request arrives on it: what a
server that drops idle keep-alive connections does to a client that reuses one at that moment.
"""

from __future__ import annotations

import asyncio

import pytest

from areal_jobs.api import Health
from areal_jobs.rollout.engine_http import EngineHTTP, ServerCallError
from areal_jobs.transport.retry import RetryPolicy

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def _read_request(reader: asyncio.StreamReader) -> bool:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    await reader.readexactly(length)
    return True


async def _serve(calls: list[str]):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _read_request(reader)
            calls.append("answered")
            writer.write(OK)
            await writer.drain()
            await asyncio.wait_for(_read_request(reader), timeout=10)
            calls.append("dropped")  # a second request on this connection: closed unanswered
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _client(port: int) -> EngineHTTP:
    return EngineHTTP("s0", f"http://127.0.0.1:{port}", "key", generate_timeout_s=10, call_timeout_s=10)


def test_control_calls_open_a_connection_each():
    async def main() -> list[str]:
        calls: list[str] = []
        server = await _serve(calls)
        http = _client(server.sockets[0].getsockname()[1])
        try:
            for endpoint in ("/pause_generation", "/flush_cache", "/continue_generation"):
                assert await http.post(endpoint, {"x": 1}) == {}
            assert await http.healthy()
        finally:
            await http.close()
            server.close()
        return calls

    assert asyncio.run(main()) == ["answered"] * 4


def test_pooled_generate_calls_reuse_connections_and_meet_the_drop():
    """The hazard the control path avoids: the second pooled call goes down the kept-alive
    connection and the server drops it (the controller re-sends a failed generate)."""

    async def main() -> list[str]:
        calls: list[str] = []
        server = await _serve(calls)
        http = _client(server.sockets[0].getsockname()[1])
        try:
            assert await http.generate("/generate", {"x": 1}) == {}
            with pytest.raises(ServerCallError, match="/generate on server s0 failed"):
                await http.generate("/generate", {"x": 2})
        finally:
            await http.close()
            server.close()
        return calls

    assert asyncio.run(main()) == ["answered", "dropped"]


# ------------------------------------------------------------------ repeats (control_calls.py)

ALREADY_OPEN = b'{"success": false, "message": "a weight-update session is already open; call end_weight_update() first"}'


def _answer(status: int, body: bytes) -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 503: b"Service Unavailable"}[status]
    head = b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (
        status,
        reason,
        len(body),
    )
    return head + body


async def _scripted(script: list[tuple | None], seen: list[str]):
    """Answers request i (over all connections) with script[i]: (status, body), or (status, body,
    delay_s) after a delay; None = never answers (held until the client gives up), as a starved
    or stalled server does."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            seen.append(head.split(b" ")[1].decode())
            step = script[len(seen) - 1] if len(seen) <= len(script) else (200, b"{}")
            if step is None:
                await reader.read()  # until the client closes
                return
            if len(step) == 3:
                await asyncio.sleep(step[2])
            writer.write(_answer(*step[:2]))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _retrying_client(port: int) -> EngineHTTP:
    policy = RetryPolicy(first_timeout_s=0.3, deadline_s=20.0, backoff_s=0.05, max_backoff_s=0.1)
    return EngineHTTP(
        "s0", f"http://127.0.0.1:{port}", "key", generate_timeout_s=10, call_timeout_s=0.3, retry=policy
    )


def _call(script, endpoint, **kwargs):
    async def main():
        seen: list[str] = []
        server = await _scripted(script, seen)
        http = _retrying_client(server.sockets[0].getsockname()[1])
        try:
            return await http.control(endpoint, {}, **kwargs), seen
        finally:
            await http.close()
            server.close()

    return asyncio.run(main())


def test_a_safe_call_that_goes_unanswered_is_repeated_until_it_is_answered():
    result, seen = _call([None, None, (503, b"{}"), (200, b'{"ok": 1}')], "/flush_cache")
    assert result == {"ok": 1} and seen == ["/flush_cache"] * 4


def test_a_state_change_is_waited_for_never_sent_twice():
    """A pause answered after 2 s, 6x its first timeout: one request, waited for. A second copy
    could run after the resume that follows and leave the server paused for good."""
    result, seen = _call([(200, b'{"paused": 1}', 2.0)], "/pause_generation")
    assert result == {"paused": 1} and seen == ["/pause_generation"]


def test_a_state_change_that_never_reached_the_server_is_sent_again():
    result, seen = _call([(503, b"{}"), (200, b"{}")], "/continue_generation")
    assert result == {} and seen == ["/continue_generation"] * 2


def test_a_resend_refused_as_already_done_counts_as_done():
    """A proxy answered begin_weight_update's first attempt with 503, yet the server had opened the
    session: the re-send is refused as 'already open', the state the call wanted."""
    result, seen = _call([(503, b"{}"), (400, ALREADY_OPEN)], "/begin_weight_update")
    assert result is None and seen == ["/begin_weight_update"] * 2


def test_the_same_refusal_on_the_first_attempt_is_an_error():
    with pytest.raises(ServerCallError, match="already open"):
        _call([(400, ALREADY_OPEN)], "/begin_weight_update")


def test_a_call_that_is_half_of_a_collective_is_never_repeated_alone():
    async def main():
        seen: list[str] = []
        server = await _scripted([None, (200, b"{}")], seen)
        http = _retrying_client(server.sockets[0].getsockname()[1])
        try:
            with pytest.raises(ServerCallError, match="timed out"):
                await http.control("/init_weights_update_group", {})
        finally:
            await http.close()
            server.close()
        return seen

    assert asyncio.run(main()) == ["/init_weights_update_group"]


def test_a_refused_connection_is_not_repeated_and_health_says_refused():
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()  # nothing listens on the port now: the process is gone
        http = _retrying_client(port)
        try:
            with pytest.raises(ServerCallError) as info:
                await http.control("/pause_generation", {})
            assert info.value.refused and not info.value.transient  # so call_with_retry raises it
            assert await http.health() is Health.refused
        finally:
            await http.close()

    asyncio.run(main())


def test_every_endpoint_the_clients_call_is_classified():
    """A control call nobody classified fails loudly at its first use (control_call raises): every
    route in the clients' source must be in CONTROL_CALLS."""
    import re
    from pathlib import Path

    from areal_jobs.rollout import control_calls

    root = Path(control_calls.__file__).parent
    routes = set()
    for name in ("sglang_client.py", "vllm_client.py", "reward_client.py"):
        routes |= set(re.findall(r'"(/[a-z_/0-9]+(?:#[a-z_]+)?)"', (root / name).read_text()))
    rpcs = set(re.findall(r'"(areal_[a-z_]+)"', (root / "vllm_client.py").read_text()))
    routes |= {f"/collective_rpc#{rpc}" for rpc in rpcs}
    routes -= {"/collective_rpc"}  # called only as /collective_rpc#<method>
    missing = sorted(r for r in routes if r not in control_calls.BY_ENDPOINT)
    assert not missing, missing


def test_docs_faults_lists_every_control_call_with_its_class():
    from pathlib import Path

    from areal_jobs.rollout.control_calls import CONTROL_CALLS

    docs = (Path(__file__).resolve().parents[3] / "docs" / "faults.md").read_text()
    for call in CONTROL_CALLS:
        assert f"| `{call.endpoint}` | {call.repeat.value} |" in docs, call.endpoint
