"""The `openai_agent` workflow: run your agent, written against the OpenAI client, as an episode.

    rollout/workflow=openai_agent rollout.workflow.agent=examples.arith_agent:agent

For every episode the workflow opens a session of the OpenAI-compatible endpoint (endpoint.py,
started on the controller's event loop the first time it is needed) and calls your function:

    async def agent(base_url: str, messages: list[dict], *, prompt_text: str, reference: str)
        -> float | None

    base_url      http://127.0.0.1:<port>/sessions/<sid>/v1: pass it to openai.AsyncOpenAI /
                  openai.OpenAI (any api_key); every completion is one model turn of the episode
    messages      the prompt as chat messages ([{"role": "user", "content": <question>}]); send
                  them first, then the history back with one new message per request
    prompt_text   the prompt exactly as the model sees it (for /v1/completions)
    reference     the prompt's reference answer (for an agent that scores itself)

It may declare only the parameters it uses (`async def agent(base_url, messages)`), or **kwargs.
Agents run on their own event loop, beside the controller's (agent_loop.py); a plain `def` runs in
that loop's thread pool (use openai.OpenAI there). The episode's reward is, first
found: what the function returns, what it posted to `<base_url>/reward` ({"reward": x}, which
also ends the episode), or the prompt's reward task on the text of its last completion.

An exception from the agent, a history the endpoint refused and never corrected, or an agent that
never called the model ends the episode with reward 0 and reward_status "error" (EpisodeError);
a failure of generation itself (the servers) ends the run, as in every workflow. On resume the
agent runs again from the start and its requests replay the recorded turns, so an agent must be
deterministic given the replies it gets (no wall clock, no unseeded randomness: context.py).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from areal_jobs.agent.agent_loop import AgentLoop
from areal_jobs.agent.chat_history import USER_SENTINEL, prompt_messages
from areal_jobs.agent.context import EpisodeContext, EpisodeError
from areal_jobs.agent.endpoint import AgentEndpoint
from areal_jobs.config import WorkflowConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentServices:
    """What every episode of one controller shares: the endpoint and the agents' own loop."""

    endpoint: AgentEndpoint
    agents: AgentLoop


# One per event loop (the controller has one): started by the first episode that needs it,
# serving every episode until the process ends.
_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task] = weakref.WeakKeyDictionary()


async def openai_agent(ctx: EpisodeContext) -> float:
    agent = resolve_agent(ctx.config.agent)
    shared = await shared_services(ctx.config)
    endpoint = shared.endpoint
    decode_raw = ctx._services.text.decode_raw  # special tokens kept: what the model saw
    prompt_text = decode_raw(ctx.prompt.input_ids)
    # how the template frames a user message: the prompt ends that way around its question
    try:
        user_opening = decode_raw(ctx.render_message("user", USER_SENTINEL))
    except ValueError:  # a template that cannot add a message: chat requests say so, completions work
        user_opening = ""
    messages = prompt_messages(prompt_text, user_opening, ctx.decode(ctx.prompt.input_ids))
    session = endpoint.open(ctx, decode_raw, messages, ctx.config.max_turns)
    arguments = {
        "base_url": endpoint.base_url(session.sid),
        "messages": [dict(m) for m in messages],
        "prompt_text": prompt_text,
        "reference": ctx.prompt.reference,
    }
    try:
        returned = await shared.agents.call(agent, declared(agent, arguments))
    except Exception as exc:
        if session.error is None:
            raise EpisodeError(f"agent {ctx.config.agent} failed: {type(exc).__name__}: {exc}") from exc
        returned = None  # the session's own failure is reported below
    finally:
        endpoint.close(session.sid)
    if session.error is not None:
        raise session.error  # EpisodeError ends the episode, anything else the run
    if not session.completions:
        raise EpisodeError(f"agent {ctx.config.agent} made no completion request")
    if returned is not None:
        if isinstance(returned, bool) or not isinstance(returned, (int, float)):
            raise TypeError(f"agent {ctx.config.agent} returned {returned!r}: return a number or None")
        return float(returned)
    if session.reward is not None:
        return session.reward
    last = session.completions[-1]
    return (await ctx.score(ctx.decode(last.token_ids))).reward


@functools.cache
def resolve_agent(target: str) -> Callable:
    """The user's agent function from "module:function" (rollout.workflow.agent)."""
    module_name, colon, attr = target.partition(":")
    if not colon or not module_name or not attr:
        raise ValueError(
            f"rollout.workflow.agent={target!r}: set it to your agent's 'module:function', e.g. "
            "rollout.workflow.agent=examples.arith_agent:agent"
        )
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"rollout.workflow.agent={target!r} cannot be loaded ({exc}); the module must be importable "
            "by the controller (the checkout's root is on its path)"
        ) from exc
    if not callable(fn):
        raise ValueError(f"rollout.workflow.agent={target!r} is not callable")
    return fn


def declared(agent: Callable, arguments: dict) -> dict:
    """The arguments `agent` declares (all of them for a **kwargs function)."""
    params = inspect.signature(agent).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return arguments
    names = {p.name for p in params}
    return {k: v for k, v in arguments.items() if k in names}


async def shared_services(config: WorkflowConfig) -> AgentServices:
    """This event loop's endpoint and agent loop, started on first use (concurrent episodes wait
    for the one start)."""
    loop = asyncio.get_running_loop()
    task = _SHARED.get(loop)
    if task is None:
        task = loop.create_task(_start(config))
        _SHARED[loop] = task
    return await asyncio.shield(task)


async def stop_shared_services() -> None:
    """Stop this event loop's endpoint and agent loop (tests; the controller's last as long as
    its process)."""
    task = _SHARED.pop(asyncio.get_running_loop(), None)
    if task is not None:
        shared = await task
        await shared.agents.stop()
        await shared.endpoint.stop()


async def _start(config: WorkflowConfig) -> AgentServices:
    endpoint = AgentEndpoint(config.endpoint_host, config.endpoint_port)
    await endpoint.start()
    return AgentServices(endpoint, AgentLoop())
