"""A scripted rollout server and an episode harness for the workflow unit tests: every /generate
answer is given in advance, so token ids, masks and versions are exact. The harness drives the
real GenerationPath and EpisodeContext; only the server and the reward are stand-ins."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from areal_jobs.agent.context import EpisodeContext, EpisodeServices, EpisodeText
from areal_jobs.agent.episode import EpisodeState
from areal_jobs.api import FinishReason, GenerateResponse, RewardResult
from areal_jobs.config import WorkflowConfig
from areal_jobs.data.prompts import Prompt
from areal_jobs.rollout.generation import GenerationPath, Sampling
from areal_jobs.rollout.server_pool import ServerPool

STOP, LENGTH, ABORT = FinishReason.stop, FinishReason.length, FinishReason.abort
PROMPT = Prompt(0, [1, 2], "arith", "7")


def answer(ids, finish=STOP, version=0, logprob=-0.5):
    return GenerateResponse(list(ids), [logprob] * len(ids), finish, version)


class Scripted:
    """Answers each /generate with the next scripted response; `before(request)` runs first."""

    def __init__(self, script, before=None):
        self.script, self.before = list(script), before
        self.requests = []
        self.name = "scripted"

    async def generate(self, request):
        self.requests.append(request)
        if self.before is not None:
            self.before(request)
        return self.script.pop(0)

    async def healthy(self):
        return True


def decode(ids):
    """Token 7 reads "The answer is 7.", 0 is the end of sequence; every other token is a letter."""
    return "".join("The answer is 7." if t == 7 else "" if t == 0 else chr(97 + t % 26) for t in ids)


def encode(text):
    return [ord(c) for c in text]


class Harness:
    """One episode of PROMPT over a scripted server, at the policy version `self.version`."""

    def __init__(self, server, config=None, max_new_tokens=10, call_tool=None):
        pool = ServerPool()
        pool.add(0, server)
        running = asyncio.Event()
        running.set()
        self.version = 0
        self.path = GenerationPath(pool, running, lambda: self.version)
        self.sampling = Sampling(max_new_tokens, temperature=1.0)
        self.config = config or WorkflowConfig(name="multi_turn_math", max_episode_tokens=1000)
        self.scored: list[str] = []

        async def generate(rid, prompt_ids, state, max_new, stop):
            return await self.path.run(rid, prompt_ids, state, replace(self.sampling, max_new_tokens=max_new))

        async def score(request):
            self.scored.append(request.response)
            return RewardResult(1.0 if request.response.endswith("7.") else 0.0)

        text = EpisodeText(encode, decode, decode, lambda role, content: ("", f"\n{content}\n"))
        self.services = EpisodeServices(
            generate, lambda: self.version, text, score, max_new_tokens, call_tool
        )

    def context(self, state: EpisodeState) -> EpisodeContext:
        return EpisodeContext(PROMPT, self.config, state, self.services, "r")
