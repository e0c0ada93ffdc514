"""engine_http: control calls never reuse a connection the server may have closed.

A real aiohttp client against a raw asyncio server on 127.0.0.1 that keeps HTTP/1.1 connections
"alive" but closes each one, without answering, when a second request arrives on it: what a
server that drops idle keep-alive connections does to a client that reuses one at that moment.
"""

from __future__ import annotations

import asyncio

import pytest

from areal_jobs.rollout.engine_http import EngineHTTP, ServerCallError

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
            for endpoint in ("/pause_generation", "/update_weights", "/continue_generation"):
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
