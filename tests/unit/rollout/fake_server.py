"""An in-process stand-in for a rollout server, for unit tests of the controller's logic only.
(The controller's integration tests run against a real SGLang server.)

Generates token `100 + position` at `token_s` per token, stops after `answer_len(prompt)` tokens
with EOS (0), honours pause(abort) by returning partial output and pause(in_place) by freezing
its requests until resume, and can be told to fail.
"""

from __future__ import annotations

import asyncio

from areal_jobs.api import FinishReason, GenerateRequest, GenerateResponse
from areal_jobs.rollout.sglang_client import ServerCallError


class FakeServer:
    def __init__(self, name: str, token_s: float = 0.002, answer_len=lambda ids: 12, status_on_fail: int = 0):
        self.name = name
        self.token_s = token_s
        self.answer_len = answer_len
        self.weight_version = 0
        self.paused = False
        self.memory_released = False  # release_memory ... resume_memory (colocated schedule)
        self.memory_calls: list[str] = []
        self.frozen = False  # paused in_place: requests in flight hold still
        self.dead = False
        self.status_on_fail = status_on_fail
        self.requests: list[GenerateRequest] = []
        self._abort = asyncio.Event()

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        if self.dead:
            raise ServerCallError(self.name, "/generate", "connection refused", self.status_on_fail)
        # its weights and KV cache are gone (on a GPU): a request now would be the controller's bug
        assert not self.memory_released, f"{self.name}: a request while its memory is released"
        self.requests.append(request)
        while self.paused:
            await asyncio.sleep(self.token_s)
        target = self.answer_len(request.input_ids)
        out: list[int] = []
        done_before = len(request.input_ids) - request.seed if request.seed else None  # unused hook
        del done_before
        position = len(request.input_ids)
        while len(out) < request.max_new_tokens:
            if self._abort.is_set():
                return GenerateResponse(out, [-1.0] * len(out), FinishReason.abort, self.weight_version)
            if self.dead:
                raise ServerCallError(self.name, "/generate", "connection reset", self.status_on_fail)
            await asyncio.sleep(self.token_s)
            while self.frozen:  # in_place: frozen, then on under whatever weights resume brings
                await asyncio.sleep(self.token_s)
            out.append(100 + position + len(out))
            if position + len(out) >= target:
                out[-1] = 0  # EOS
                return GenerateResponse(out, [-1.0] * len(out), FinishReason.stop, self.weight_version)
        return GenerateResponse(out, [-1.0] * len(out), FinishReason.length, self.weight_version)

    async def pause(self, mode: str) -> None:
        self.paused = True
        self.frozen = mode == "in_place"
        if mode == "abort":
            self._abort.set()
            await asyncio.sleep(self.token_s * 3)  # let in-flight calls return
            self._abort.clear()

    async def resume(self) -> None:
        self.paused = False
        self.frozen = False

    async def release_memory(self) -> None:
        self.memory_released = True
        self.memory_calls.append("release")

    async def resume_memory(self) -> None:
        self.memory_released = False
        self.memory_calls.append("resume")

    async def healthy(self) -> bool:
        return not self.dead

    async def abort_all(self) -> None:
        self._abort.set()
        await asyncio.sleep(self.token_s * 3)
        self._abort.clear()


class ZeroScorer:
    async def score_group(self, requests):
        from areal_jobs.api import RewardResult

        return [RewardResult(1.0 if r.response.endswith("!") else 0.0) for r in requests]

    def metrics(self):
        return {}
