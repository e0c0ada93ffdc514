"""One agent session of the OpenAI-compatible endpoint: an episode seen through OpenAI requests.

    request (messages | prompt) ──▶ what it adds to the episode (chat_history.py; else HTTP 400)
        ──▶ ctx.append(...)              the new message's tokens: loss mask 0
        ──▶ ctx.generate(max, stop)      one model turn: loss mask 1, behaviour log-probs, versions
        ──▶ OpenAI-shaped response       id, choices[0].message.content / text, finish_reason, usage

A session is one episode, so its requests are served one at a time, in order, through one API
(chat or completions). It ends when the agent posts a reward or its workflow closes it. A failure
inside the episode (a generation error, the workflow's EpisodeError) is kept, so the workflow
reports it even when the agent swallowed the HTTP error.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from areal_jobs.agent.chat_history import ChatHistory, HistoryMismatch, text_delta

if TYPE_CHECKING:
    from areal_jobs.agent.episode import EpisodeState

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
    """What a session uses of its agent.context.EpisodeContext."""

    state: EpisodeState

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def version(self) -> int: ...

    async def generate(
        self, max_new_tokens: int | None = None, stop: tuple[str, ...] | None = None
    ) -> Turn: ...

    def append(self, token_ids: list[int]) -> None: ...

    def render_message(self, role: str, content: str) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Completion:
    """One model turn served by the session, as recorded in the episode state."""

    start: int  # ctx.token_ids[start:start + len(token_ids)] are the turn's tokens
    token_ids: list[int]
    logprobs: list[float]  # behaviour log-probs, one per token
    versions: list[int]  # policy version each token was sampled under
    text: str  # chat: the reply's content (special tokens dropped); completions: the raw text
    finish_reason: str

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class AgentSession:
    """Serves one episode's OpenAI requests. Plain object: the endpoint routes HTTP to it."""

    def __init__(
        self,
        sid: str,
        ctx: Episode,
        decode_raw: Callable[[list[int]], str],
        prompt_messages: list[dict],
        max_turns: int,
    ) -> None:
        self.sid = sid
        self.ctx = ctx
        self.decode_raw = decode_raw  # token ids -> text with special tokens (what the model saw)
        self.history = ChatHistory(prompt_messages)
        self.max_turns = max_turns
        self.completions: list[Completion] = []
        self.reward: float | None = None  # posted by the agent: the episode's reward
        self.error: BaseException | None = None  # the episode failed; every later request says so
        self._api = ""  # "chat" or "completions": the first request decides
        self._busy = False
        self._turn_task: asyncio.Task | None = None  # the request generating now
        # where this session is in the episode: ctx.token_ids is the whole recorded episode while
        # a resumed run replays it, the session's requests only reach this far
        self._prompt_len = len(ctx.token_ids) - len(ctx.state.output_ids)
        self._position = self._prompt_len

    # ------------------------------------------------------------------ requests

    async def chat_completion(self, body: dict) -> dict:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise RequestError("'messages' must be a list of message objects")

        def extension() -> tuple[list[int], object]:
            new = self.history.new_message(messages)
            try:
                return (self.ctx.render_message(new.role, new.content) if new else []), new
            except ValueError as exc:  # the template cannot render one more message
                raise RequestError(f"cannot render the new message: {exc}") from None

        new, completion = await self._serve(body, "chat", extension)
        self.history.commit(new, completion.text)
        choice = {"message": {"role": "assistant", "content": completion.text}}
        if body.get("logprobs"):
            pairs = zip(completion.token_ids, completion.logprobs)
            choice["logprobs"] = {"content": [self._token_logprob(t, lp) for t, lp in pairs]}
        return self._response(body, "chat.completion", completion, choice)

    async def completion(self, body: dict) -> dict:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            text = prompt

            def extension() -> tuple[list[int], object]:
                delta = text_delta(self.decode_raw(self.episode_ids), text)
                return (self.ctx.encode(delta) if delta else []), None
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt

            def extension() -> tuple[list[int], object]:
                episode = self.episode_ids
                if ids[: len(episode)] != episode:
                    raise HistoryMismatch(
                        f"the prompt's token ids do not start with this session's {len(episode)} episode "
                        "token ids: send the earlier prompt and completion ids unchanged, then new ones"
                    )
                return ids[len(episode) :], None
        else:
            raise RequestError("'prompt' must be one string or one list of token ids")
        _, completion = await self._serve(body, "completions", extension)
        choice = {"text": completion.text}
        if body.get("logprobs"):
            tokens = [self.decode_raw([t]) for t in completion.token_ids]
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": completion.logprobs,
                "top_logprobs": None,
            }
        return self._response(body, "text_completion", completion, choice)

    def post_reward(self, body: dict) -> dict:
        self._check_open()
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise RequestError("'reward' must be a finite number")
        self.reward = float(reward)
        return {"session": self.sid, "reward": self.reward, "num_turns": len(self.completions)}

    def summary(self) -> dict:
        """The episode so far: every completion's place, tokens, log-probs and versions."""
        return {
            "session": self.sid,
            "num_tokens": self._position,
            "loss_mask": list(self.ctx.state.loss_mask[: self._position - self._prompt_len]),
            "completions": [
                {
                    "start": c.start,
                    "token_ids": c.token_ids,
                    "logprobs": c.logprobs,
                    "versions": c.versions,
                    "finish_reason": c.finish_reason,
                }
                for c in self.completions
            ],
            "reward": self.reward,
            "error": None if self.error is None else str(self.error),
        }

    def close(self) -> None:
        """The workflow is done with the episode: a turn still generating (for an agent that
        returned, or was cancelled, without waiting for it) stops and writes no more tokens."""
        if self._busy and self._turn_task is not None:
            self._turn_task.cancel()

    @property
    def episode_ids(self) -> list[int]:
        """The episode as far as this session's requests have taken it (prompt included)."""
        return self.ctx.token_ids[: self._position]

    # ------------------------------------------------------------------ one turn

    def _check_open(self) -> None:
        if self.error is not None:
            raise RequestError(f"this session's episode failed: {self.error}")
        if self.reward is not None:
            raise RequestError("this session's episode ended: its reward was posted")

    async def _serve(self, body: dict, api: str, extension) -> tuple[object, Completion]:
        self._check_open()
        if self._busy:
            raise RequestError("a completion of this session is still running: send one request at a time")
        if self._api and self._api != api:
            route = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}[self._api]
            raise RequestError(f"this session uses {route}: one API per session (its history is that API's)")
        max_new_tokens, stop = _sampling(body)
        if len(self.completions) >= self.max_turns:
            raise RequestError(
                f"the episode already has {self.max_turns} model turns "
                f"(rollout.workflow.max_turns={self.max_turns})"
            )
        try:
            delta, new = extension()  # nothing changes in the episode before this succeeds
        except HistoryMismatch as exc:
            raise RequestError(str(exc)) from None
        self._busy, self._api, self._turn_task = True, api, asyncio.current_task()
        try:
            if delta:
                self.ctx.append(delta)
            start = self._position + len(delta)
            turn = await self.ctx.generate(max_new_tokens=max_new_tokens, stop=stop)
        except BaseException as exc:
            self.error = exc  # the episode is in an unknown state: no further turn
            raise
        finally:
            self._busy = False
        ids = list(turn.token_ids)
        self._position = start + len(ids)
        offset = start - self._prompt_len  # in the state's output_ids
        state = self.ctx.state
        completion = Completion(
            start,
            ids,
            list(state.logprobs[offset : offset + len(ids)]),
            list(state.versions[offset : offset + len(ids)]),
            turn.text if api == "chat" else self.decode_raw(ids),
            turn.finish_reason,
        )
        self.completions.append(completion)
        return new, completion

    def _token_logprob(self, token_id: int, logprob: float) -> dict:
        token = self.decode_raw([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}

    def _response(self, body: dict, kind: str, completion: Completion, choice: dict) -> dict:
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        choice.setdefault("logprobs", None)
        return {
            "id": f"{prefix}-{self.sid[:12]}-{len(self.completions)}",
            "object": kind,
            "created": int(time.time()),
            "model": str(body.get("model") or MODEL_NAME),
            "choices": [{"index": 0, **choice, "finish_reason": completion.finish_reason}],
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
        raise RequestError("n must be 1: a session is one episode (each episode of a group has its own)")
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
