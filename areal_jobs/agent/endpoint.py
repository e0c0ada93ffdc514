"""The OpenAI-compatible endpoint: any agent written against the `openai` client trains by
pointing its `base_url` at a session of this HTTP service.

    POST /sessions/<sid>/v1/chat/completions   one model turn of the session's episode (chat)
    POST /sessions/<sid>/v1/completions        one model turn (prompt text or token ids)
    GET  /sessions/<sid>/v1/models             the one model, for clients that list them
    POST /sessions/<sid>/v1/reward             {"reward": x}: the episode's reward; it ends it
                                               (also at /sessions/<sid>/reward)
    GET  /sessions/<sid>                       the episode so far (turn offsets, versions, reward)

It runs on the rollout controller's event loop, inside the controller process (no new process or
node: on SLURM it lives in the controller's task of the existing job). It binds 127.0.0.1 unless
told otherwise (rollout.workflow.endpoint_host / endpoint_port); a session id is 128 random bits,
handed only to the agent of that episode, and is the session's only credential. Every request
becomes one `ctx.generate()` of that session's EpisodeContext (endpoint_session.py), so turns are
interrupted by weight updates and continued like any other, and every model token keeps its
behaviour log-prob and version in the episode state. Non-streaming only.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket

from aiohttp import web

from areal_jobs.agent.context import EpisodeError
from areal_jobs.agent.endpoint_session import MODEL_NAME, AgentSession, Episode, RequestError

logger = logging.getLogger(__name__)


class AgentEndpoint:
    """The HTTP service and its open sessions. `start` binds; `open`/`close` bracket an episode."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port  # 0: any free port, known after start
        self.sessions: dict[str, AgentSession] = {}
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        # bound to every interface: the node's name is what other hosts of the job can reach
        host = socket.gethostname() if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def base_url(self, sid: str) -> str:
        """What the agent's OpenAI client gets as base_url."""
        return f"{self.url}/sessions/{sid}/v1"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)  # long histories: up to 64 MiB of JSON
        app.add_routes(
            [
                web.post("/sessions/{sid}/v1/chat/completions", self._chat),
                web.post("/sessions/{sid}/v1/completions", self._completions),
                web.get("/sessions/{sid}/v1/models", self._models),
                # under v1 too, so `client.post("/reward", ...)` of the agent's own client reaches it
                web.post("/sessions/{sid}/v1/reward", self._reward),
                web.post("/sessions/{sid}/reward", self._reward),
                web.get("/sessions/{sid}", self._summary),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        logger.info("agent endpoint on %s (sessions at %s/sessions/<sid>/v1)", self.url, self.url)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, ctx: Episode, decode_raw, prompt_messages: list[dict], max_turns: int) -> AgentSession:
        """A new session for the episode of `ctx`; the agent gets `base_url(session.sid)`."""
        sid = secrets.token_hex(16)
        session = AgentSession(sid, ctx, decode_raw, prompt_messages, max_turns)
        self.sessions[sid] = session
        return session

    def close(self, sid: str) -> None:
        """The episode is over for the endpoint: later requests of the session get 404."""
        session = self.sessions.pop(sid, None)
        if session is not None:
            session.close()

    # ------------------------------------------------------------------ routes

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._call(request, lambda s, body: s.chat_completion(body))

    async def _completions(self, request: web.Request) -> web.Response:
        return await self._call(request, lambda s, body: s.completion(body))

    async def _reward(self, request: web.Request) -> web.Response:
        async def post(session: AgentSession, body: dict) -> dict:
            return session.post_reward(body)

        return await self._call(request, post)

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except RequestError as exc:
            return _error(exc)
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "areal_jobs"}]}
        )

    async def _summary(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(self._session(request).summary())
        except RequestError as exc:
            return _error(exc)

    async def _call(self, request: web.Request, handler) -> web.Response:
        try:
            session = self._session(request)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise RequestError("the request body is not JSON") from None
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            return web.json_response(await handler(session, body))
        except RequestError as exc:
            return _error(exc)
        except Exception as exc:  # kept on the session too: its workflow reports it
            logger.warning("agent session %s failed: %r", request.match_info["sid"][:8], exc)
            return _error(RequestError(f"the episode failed: {type(exc).__name__}: {exc}", _status(exc)))

    def _session(self, request: web.Request) -> AgentSession:
        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            raise RequestError("unknown session: it never existed or its episode is over", 404)
        return session


def _status(exc: Exception) -> int:
    """An episode error (the workflow's EpisodeError: too long, a replay that diverged) is the
    agent's to handle (400); anything else is the server's (500)."""
    return 400 if isinstance(exc, EpisodeError) else 500


def _error(exc: RequestError) -> web.Response:
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    if exc.status == 404:
        kind = "not_found_error"
    payload = {"error": {"message": str(exc), "type": kind, "param": None, "code": None}}
    return web.json_response(payload, status=exc.status)
