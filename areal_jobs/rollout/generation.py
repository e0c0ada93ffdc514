"""The one generation path: send a sample's request to a server and continue it until it ends.

Training samples and evaluation answers both go through `GenerationPath.run`, so failover,
interruption and version stamping behave the same for both (a fix to one is a fix to both):

- it waits while `running` is cleared (a weight update is under way);
- it sends to the least-loaded up server; with none up it waits and tries again;
- a server error marks the server down (when its health check fails too) and the request is
  re-sent, with the partial output, to another server; a client error (our request was wrong)
  is raised at once, since failing over would repeat it everywhere;
- an answer interrupted by a weight update (finish_reason abort) is continued as
  prompt + partial output, under the new weights;
- a sample is an episode (agent/episode.py): `run` generates its open model turn (the next turn
  of a multi-turn episode is sent as prompt + every episode token so far);
- every token keeps its behaviour log-prob and the policy version it was sampled under; a
  segment that may straddle an update carries the older version for all its tokens, so
  staleness is never under-counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from areal_jobs.agent.episode import EpisodeState
from areal_jobs.api import FinishReason, GenerateRequest
from areal_jobs.rollout.engine_http import ServerCallError
from areal_jobs.rollout.server_pool import NoServerAvailable, ServerPool

MAX_SEGMENTS = 10_000  # a sample is re-sent at most this often (every update interrupts it once)
NO_SERVER_WAIT_S = 1.0  # bounded by MAX_SEGMENTS; servers come back or the job fails


@dataclass
class GenerationCounters:
    """What the path did (the controller's RolloutCounters extend these)."""

    generated_tokens: int = 0
    interrupted_requests: int = 0
    server_errors: int = 0
    segments: int = 0
    # segments re-sent after an interruption, and their input tokens (prompt + partial output),
    # which the server prefills again: the cost of pause_mode=abort
    resubmitted_segments: int = 0
    reprefill_tokens: int = 0
    # segments that an update caught in flight and that went on under the new weights (in_place)
    straddled_segments: int = 0


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()  # end-of-sequence / end-of-turn ids (kept in the output)
    stop: tuple[str, ...] = ()  # stop strings (kept in the output: the policy learns to stop)

    def for_turn(self, max_new_tokens: int, stop: Sequence[str] | None) -> Sampling:
        """These settings for one turn of an episode: its token budget, and its stop strings
        (None: the run's)."""
        if max_new_tokens == self.max_new_tokens and stop is None:
            return self
        return replace(self, max_new_tokens=max_new_tokens, stop=self.stop if stop is None else tuple(stop))


class GenerationPath:
    """Runs samples to the end on a server pool. Plain object: the pool and clock are injected."""

    def __init__(
        self,
        pool: ServerPool,
        running: asyncio.Event,
        version: Callable[[], int],
        counters: GenerationCounters | None = None,
    ) -> None:
        self.pool = pool
        self.running = running  # set: requests may be sent; cleared while weights change
        self.version = version  # the policy version the servers hold now
        self.counters = counters if counters is not None else GenerationCounters()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        """Requests of this path being served right now."""
        return self._in_flight

    async def run(self, rid: str, prompt_ids: list[int], state: EpisodeState, sampling: Sampling) -> str:
        """Generate the state's model turn to stop or length (up to sampling.max_new_tokens tokens),
        continuing from the tokens the turn already holds; returns the turn's finish reason.

        `rid` names the turn; segment s is sent as f"{rid}.{s}" (unique on the server)."""
        turn_start = state.open_turn()
        for segment in range(MAX_SEGMENTS):
            produced = len(state.output_ids) - turn_start
            remaining = sampling.max_new_tokens - produced
            if remaining <= 0:
                return state.close_turn(FinishReason.length.value)
            await self.running.wait()
            try:
                slot = self.pool.least_loaded()
            except NoServerAvailable:
                await asyncio.sleep(NO_SERVER_WAIT_S)
                continue
            sent_version = self.version()
            request = GenerateRequest(
                rid=f"{rid}.{segment}",
                input_ids=prompt_ids + state.output_ids,
                max_new_tokens=remaining,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                stop_token_ids=sampling.stop_token_ids,
                stop=sampling.stop,
                # prefix-cache namespace: no request reuses KV that older weights computed
                # (pause_mode=in_place never flushes the cache: docs/protocols.md)
                cache_salt=f"v{sent_version}",
            )
            if produced:
                self.counters.resubmitted_segments += 1
                self.counters.reprefill_tokens += len(request.input_ids)
            slot.in_flight += 1
            self._in_flight += 1
            try:
                response = await slot.client.generate(request)
            except ServerCallError as exc:
                if exc.is_client_error:
                    raise
                self.counters.server_errors += 1
                if not await slot.client.healthy():  # a dropped connection alone is not a dead server
                    self.pool.mark_down(slot.index, str(exc))
                continue  # re-sent with its partial output (to another server if this one is down)
            finally:
                slot.in_flight -= 1
                self._in_flight -= 1
            self.counters.segments += 1
            slot.completed += 1
            version = min(sent_version, response.weight_version)
            if response.weight_version > sent_version:
                self.counters.straddled_segments += 1
            state.add_model_tokens(response.output_ids, response.logprobs, version, response.routes)
            self.counters.generated_tokens += len(response.output_ids)
            if response.finish_reason is FinishReason.abort:
                state.interruptions += 1
                self.counters.interrupted_requests += 1
                continue
            return state.close_turn(response.finish_reason.value)
        raise RuntimeError(f"sample {rid} was interrupted {MAX_SEGMENTS} times")
