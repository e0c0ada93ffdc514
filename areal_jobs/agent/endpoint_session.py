"""One agent session of the OpenAI-compatible endpoint: an episode seen through OpenAI requests.

    request (messages | prompt) ──▶ token-exact extension of the episode (chat_format.py)
        ──▶ ctx.append(delta)            environment tokens, loss mask 0
        ──▶ ctx.generate(max, stop)      one model turn: loss mask 1, behaviour log-probs, versions
        ──▶ OpenAI-shaped response       id, choices[0].message.content / text, finish_reason, usage

A session is one episode, so its requests are served one at a time, in order. It ends when the
agent posts a reward or its workflow closes it; a failure inside the episode (a history that does
not extend it, too many turns, a generation error) is kept so the workflow can report it even if
the agent swallowed the HTTP error.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

from areal_jobs.agent.chat_format import ChatFormat, HistoryMismatch

MODEL_NAME = "areal-policy"  # what /v1/models lists; any model name is accepted in requests


class RequestError(ValueError):
    """The request cannot be served (HTTP `status`, OpenAI error `message`)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Turn(Protocol):
    token_ids: list[int]
    text: str
    finish_reason: str


class Episode(Protocol):
    """What a session needs of its agent/context.EpisodeContext."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def version(self) -> int: ...

    async def generate(self, max_new_tokens: int | None = None, stop: tuple[str, ...] | None = None) -> Turn: ...

    def append(self, token_ids: list[int]) -> None: ...


@dataclass(frozen=True)
class Completion:
    """One model turn served by the session: its tokens sit at ctx.token_ids[start:end]."""

    start: int
    token_ids: list[int]
    text: str  # chat: the content returned (special tokens dropped); completions: the raw text
    finish_reason: str
    version: int  # the policy version when the turn was requested (per-token versions: episode state)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class AgentSession:
    """Serves one episode's OpenAI requests. Plain object: the endpoint routes HTTP to it."""

    def __init__(self, sid: str, ctx: Episode, chat: ChatFormat, max_turns: int) -> None:
        self.sid = sid
        self.ctx = ctx
        self.chat = chat
        self.max_turns = max_turns
        self.completions: list[Completion] = []
        self.reward: float | None = None  # posted by the agent: the episode's reward
        self.error: BaseException | None = None  # the episode failed; every later request says so
        self._busy = False

    # ------------------------------------------------------------------ requests

    async def chat_completion(self, body: dict) -> dict:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise RequestError("'messages' must be a list of message objects")
        completion = await self._serve(body, lambda: self._render(messages), raw_text=False)
        message = {"role": "assistant", "content": completion.text}
        return self._response(body, "chat.completion", completion, {"message": message})

    async def completion(self, body: dict) -> dict:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            completion = await self._serve(body, lambda: self._extend_text(prompt), raw_text=True)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            completion = await self._serve(body, lambda: self._extend_ids(prompt), raw_text=True)
        else:
            raise RequestError("'prompt' must be one string or one list of token ids")
        return self._response(body, "text_completion", completion, {"text": completion.text})

    def post_reward(self, body: dict) -> dict:
        self._check_open()
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise RequestError("'reward' must be a finite number")
        self.reward = float(reward)
        return {"session": self.sid, "reward": self.reward, "num_turns": len(self.completions)}

    def summary(self) -> dict:
        return {
            "session": self.sid,
            "num_tokens": len(self.ctx.token_ids),
            "completions": [
                {"start": c.start, "end": c.end, "finish_reason": c.finish_reason, "version": c.version}
                for c in self.completions
            ],
            "reward": self.reward,
            "error": None if self.error is None else str(self.error),
        }

    # ------------------------------------------------------------------ one turn

    def _check_open(self) -> None:
        if self.error is not None:
            raise RequestError(f"this session's episode failed: {self.error}")
        if self.reward is not None:
            raise RequestError("this session's episode ended: its reward was posted")

    async def _serve(self, body: dict, extension, raw_text: bool) -> Completion:
        self._check_open()
        if self._busy:
            raise RequestError("a completion of this session is still running: send one request at a time")
        max_new_tokens, stop = _sampling(body)
        if len(self.completions) >= self.max_turns:
            raise RequestError(
                f"the episode already has {self.max_turns} model turns "
                f"(rollout.workflow.max_turns={self.max_turns})"
            )
        delta = extension()  # RequestError / HistoryMismatch: nothing was changed
        self._busy = True
        try:
            if delta:
                self.ctx.append(delta)
            start, version = len(self.ctx.token_ids), self.ctx.version
            turn = await self.ctx.generate(max_new_tokens=max_new_tokens, stop=stop)
        except BaseException as exc:
            self.error = exc  # the episode is in an unknown state: no further turn
            raise
        finally:
            self._busy = False
        ids = list(turn.token_ids)
        text = self.chat.decode_raw(ids) if raw_text else turn.text
        completion = Completion(start, ids, text, turn.finish_reason, version)
        self.completions.append(completion)
        return completion

    def _render(self, messages: list[dict]) -> list[int]:
        try:
            return self.chat.extension(self.ctx.token_ids, self.chat.render(messages))
        except HistoryMismatch as exc:
            raise RequestError(str(exc)) from None
        except ValueError as exc:  # a message the template cannot render
            raise RequestError(f"cannot render the messages: {exc}") from None

    def _extend_text(self, prompt: str) -> list[int]:
        try:
            return self.chat.extension(self.ctx.token_ids, prompt)
        except HistoryMismatch as exc:
            raise RequestError(str(exc)) from None

    def _extend_ids(self, prompt: list[int]) -> list[int]:
        episode = self.ctx.token_ids
        if prompt[: len(episode)] != episode:
            raise RequestError(
                f"the prompt's token ids do not start with this session's {len(episode)} episode "
                "token ids: send the earlier prompt and completion token ids unchanged, then new ones"
            )
        return prompt[len(episode) :]

    def _response(self, body: dict, kind: str, completion: Completion, choice: dict) -> dict:
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        return {
            "id": f"{prefix}-{self.sid[:12]}-{len(self.completions)}",
            "object": kind,
            "created": int(time.time()),
            "model": str(body.get("model") or MODEL_NAME),
            "choices": [
                {"index": 0, **choice, "finish_reason": completion.finish_reason, "logprobs": None}
            ],
            "usage": {
                "prompt_tokens": completion.start,
                "completion_tokens": len(completion.token_ids),
                "total_tokens": completion.end,
            },
        }


def _sampling(body: dict) -> tuple[int | None, tuple[str, ...] | None]:
    """max tokens and stop strings from a request; the rest of sampling is the rollout's own
    (rollout.temperature, rollout.top_p: the behaviour policy the trainer's loss assumes)."""
    if body.get("stream"):
        raise RequestError("stream=true is not supported: this endpoint answers non-streaming requests only")
    if body.get("n", 1) != 1:
        raise RequestError("n must be 1: a session is one episode (open more sessions for more samples)")
    if body.get("tools") or body.get("functions"):
        raise RequestError("tool definitions are not supported: put tool calls and results in the messages")
    for key in ("echo", "suffix", "best_of"):
        if body.get(key) not in (None, False, 1):
            raise RequestError(f"{key!r} is not supported")
    max_new_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_new_tokens is not None and (
        isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1
    ):
        raise RequestError("max_tokens must be a positive integer")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop) or None
    elif stop is not None:
        raise RequestError("'stop' must be a string or a list of strings")
    return max_new_tokens, stop

