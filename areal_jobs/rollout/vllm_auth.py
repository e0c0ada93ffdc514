"""ASGI middleware for the vLLM server: the job's API key on every route, not only /v1.

vLLM's own `--api-key` check guards only paths under /v1, /v2, /inference and /cohere; the RL and
dev routes this project drives (/pause, /resume, /abort_requests, /collective_rpc,
/update_weight_version, /reset_prefix_cache) and /health would be open to anyone who can reach the
port. vLLM loads this class with `--middleware areal_jobs.rollout.vllm_auth.RequireApiKey`; it reads
the key from VLLM_API_KEY (the variable vLLM itself reads, so the key is never on a command line).
Runs in the vLLM venv: standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

KEY_ENV = "VLLM_API_KEY"


class RequireApiKey:
    """401 for any HTTP or websocket request without `Authorization: Bearer <key>`."""

    def __init__(self, app) -> None:
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"{KEY_ENV} is empty: the server would be open; the launcher sets it")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
