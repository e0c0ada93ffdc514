"""EpisodeContext: the only thing a workflow sees, and the recording that makes episodes resumable.

    workflow(ctx) ──▶ ctx.generate()      one model turn over the controller's GenerationPath
                      ctx.append(ids)     user / environment / tool tokens (loss mask 0)
                      ctx.call_tool(...)  a tool in the sandbox (result text; errors as text)
                      ctx.score(text)     the prompt's reward task, via the reward service
                 ◀── reward (float)

Token-exact: the episode is the server's token ids back to back; model output is never
re-tokenised, and `render_message` renders only the new message with the tokenizer's own chat
template (data/chat.py).

**Replay.** Every generate, append and call_tool is recorded in `EpisodeState.events`. A workflow
re-run on a restored state (a resumed run) replays them in order: `generate` returns the recorded
turn, or continues the turn that was in progress from its partial tokens; `append` checks its
tokens equal the recorded ones; `call_tool` returns the recorded result without running the tool.
Workflows must therefore be deterministic given their inputs (prompt, config, what the context
returns): no wall-clock time, no unseeded randomness, no state outside the context. A workflow
that diverges from its recording raises EpisodeError.

Exceptions from a workflow end the run (like any group task failing), except `EpisodeError`,
which ends only its episode, with reward 0 and reward_status "error".
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from areal_jobs.agent.episode import ENV, MODEL, TOOL, EpisodeState
from areal_jobs.api import RewardRequest, RewardResult
from areal_jobs.config import WorkflowConfig
from areal_jobs.data.prompts import Prompt

logger = logging.getLogger(__name__)

ERROR_STATUS = "error"  # reward_status of an episode ended by EpisodeError


class EpisodeError(Exception):
    """Ends one episode (reward 0, reward_status "error") without ending the run."""


@dataclass(frozen=True)
class Turn:
    token_ids: list[int]  # exactly what the server returned (the end-of-turn token included)
    text: str  # decoded without special tokens (what a reward function reads)
    finish_reason: str  # "stop" | "length"


@dataclass(frozen=True)
class EpisodeText:
    """The tokenizer and chat template, as the controller lends them to every episode."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]  # special tokens dropped (rewards)
    decode_raw: Callable[[list[int]], str]  # special tokens kept (what the model saw)
    # (role, content) -> (closing, opening): the text the template puts after an assistant message,
    # and the new message plus the next assistant turn's generation prompt (PromptFormat.message_texts)
    message_texts: Callable[[str, str], tuple[str, str]]


# (rid, prompt_ids, state, max_new_tokens, stop or None for the rollout's) -> the turn's finish reason;
# generates (or continues) the state's open model turn: the controller's GenerationPath.run
GenerateTurn = Callable[[str, list[int], EpisodeState, int, "tuple[str, ...] | None"], Awaitable[str]]
ToolRunner = Callable[[str, str], Awaitable[str]]  # (name, arguments) -> result text


@dataclass(frozen=True)
class EpisodeServices:
    """What the controller lends every episode (one per controller)."""

    generate: GenerateTurn
    version: Callable[[], int]  # the policy version the servers hold now
    text: EpisodeText
    score: Callable[[RewardRequest], Awaitable[RewardResult]]
    max_new_tokens: int  # rollout.max_new_tokens: one turn's default cap
    call_tool: ToolRunner | None = None  # None: areal_jobs.agent.tools.call_tool in the sandbox
    # the model's context (config.json max_position_embeddings): prompt + episode + a turn fit in
    # it, or the server refuses the request; 0 = unbounded
    max_context_tokens: int = 0


class EpisodeContext:
    """One episode of one prompt. Built by the controller for every sample (and again on resume)."""

    def __init__(
        self, prompt: Prompt, config: WorkflowConfig, state: EpisodeState, services: EpisodeServices, rid: str
    ) -> None:
        self.prompt = prompt
        self.config = config
        self.state = state  # read it (token ids, log-probs, versions of every turn); never mutate it
        self._services = services
        self._rid = rid  # request id prefix, unique on the servers
        self._cursor = 0  # events replayed or recorded so far by this run of the workflow
        self.reward_status = ""  # of the latest ctx.score; the episode's unless it fails

    # ------------------------------------------------------------------ what the model sees

    @property
    def token_ids(self) -> list[int]:
        """Prompt + every episode token so far: the input of the next model turn."""
        return self.prompt.input_ids + self.state.output_ids

    @property
    def version(self) -> int:
        return self._services.version()

    @property
    def num_turns(self) -> int:
        """Model turns this workflow run has done (replayed ones included)."""
        return sum(1 for e in self.state.events[: self._cursor] if e[0] == MODEL)

    @property
    def num_tool_calls(self) -> int:
        return sum(1 for e in self.state.events[: self._cursor] if e[0] == TOOL)

    def decode(self, token_ids: list[int]) -> str:
        return self._services.text.decode(list(token_ids))

    def encode(self, text: str) -> list[int]:
        return self._services.text.encode(text)

    # ------------------------------------------------------------------ turns

    async def generate(self, max_new_tokens: int | None = None, stop: tuple[str, ...] | None = None) -> Turn:
        """One model turn from `token_ids`: loss mask 1, behaviour log-probs and per-token versions;
        interrupted by weight updates and continued under the new weights (GenerationPath)."""
        event = self._recorded(MODEL)
        if event is not None and event[3]:  # a finished turn of the recording
            self._cursor += 1
            return self._turn(event)
        turn_start = event[1] if event is not None else len(self.state.output_ids)
        limit = max_new_tokens or self._services.max_new_tokens
        if self.config.max_episode_tokens:  # all episode tokens, environment ones included
            limit = min(limit, self.config.max_episode_tokens - turn_start)
        if self._services.max_context_tokens:  # a turn that does not fit ends by length at once
            limit = min(limit, self._services.max_context_tokens - len(self.prompt.input_ids) - turn_start)
        index = self.num_turns  # model turns before this one
        rid = self._rid if index == 0 else f"{self._rid}-t{index}"
        await self._services.generate(rid, self.prompt.input_ids, self.state, max(limit, 0), stop)
        self._cursor += 1
        return self._turn(self.state.events[self._cursor - 1])

    def append(self, token_ids: list[int]) -> None:
        """Tokens the model did not sample (user, environment, tool output): loss mask 0."""
        token_ids = [int(t) for t in token_ids]
        event = self._recorded(ENV)
        if event is not None:
            if self.state.span(event) != token_ids:
                raise EpisodeError(
                    f"replay of {self.state.sample_id}: appended tokens differ from the recording"
                )
            self._cursor += 1
            return
        self.state.add_env_tokens(token_ids, self._services.version())
        self._cursor += 1

    def render_message(self, role: str, content: str) -> list[int]:
        """Token ids of one more chat message ("user" or "tool") after the model's turn, followed by
        the next assistant turn's generation prompt; raw text when the model has no chat template.
        The end-of-turn text the model already produced is not repeated."""
        closing, opening = self._services.text.message_texts(role, content)
        last = self.state.events[self._cursor - 1] if self._cursor else None
        if last is None or last[0] != MODEL:
            closing = ""  # the message follows the prompt or another message, not an assistant turn
        else:
            produced = self._services.text.decode_raw(self.state.span(last)[-8:])
            k = next((k for k in range(len(closing), 0, -1) if produced.endswith(closing[:k])), 0)
            closing = closing[k:]
        return self.encode(closing + opening)

    # ------------------------------------------------------------------ reward and tools

    async def score(self, text: str) -> RewardResult:
        """`text` scored by the prompt's reward task against its reference (the reward service)."""
        result = await self._services.score(
            RewardRequest(
                self.prompt.reward_task, text, self.prompt.reference,
                prompt=self._services.text.decode_raw(self.prompt.input_ids),
                data_source=self.prompt.data_source, extra_info=self.prompt.extra_info,
            )
        )  # fmt: skip
        self.reward_status = result.status.value
        return result

    async def call_tool(self, name: str, arguments: str) -> str:
        """Run tool `name` in the sandbox; its result text (errors, timeouts, cut output as text).
        Append what the model should see of it yourself (render_message("tool", result))."""
        event = self._recorded(TOOL)
        if event is not None:
            if (event[3]["name"], event[3]["arguments"]) != (name, arguments):
                raise EpisodeError(f"replay of {self.state.sample_id}: tool call differs from the recording")
            self._cursor += 1
            return event[3]["result"]
        runner = self._services.call_tool
        if runner is None:
            from areal_jobs.agent import tools  # the sandboxed tools (owned by agent/tools.py)

            result = await tools.call_tool(name, arguments, self.config)
        else:
            result = await runner(name, arguments)
        self.state.add_tool_call(name, arguments, result)
        self._cursor += 1
        return result

    # ------------------------------------------------------------------ internals

    def _recorded(self, kind: str) -> list | None:
        """The next event of the recording, which must be of `kind`; None past its end."""
        if self._cursor >= len(self.state.events):
            return None
        event = self.state.events[self._cursor]
        if event[0] != kind:
            raise EpisodeError(
                f"replay of {self.state.sample_id}: the workflow did {kind!r} where the recording has "
                f"{event[0]!r} (workflows must be deterministic: agent/context.py)"
            )
        return event

    def _turn(self, event: list) -> Turn:
        ids = self.state.span(event)
        return Turn(ids, self.decode(ids), event[3])


Workflow = Callable[[EpisodeContext], Awaitable[float]]


async def run_episode(workflow: Workflow, ctx: EpisodeContext) -> None:
    """Run (or resume) one episode to its reward, stored on the state."""
    try:
        reward = float(await workflow(ctx))
        status = ctx.reward_status or "ok"
    except EpisodeError as exc:
        logger.warning("episode %s ended with an error: %s", ctx.state.sample_id, exc)
        reward, status = 0.0, ERROR_STATUS
    ctx.state.reward, ctx.state.reward_status = reward, status
