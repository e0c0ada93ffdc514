"""The client of one reward-model server (reward.model.*): api.ScoringClient over the engines' HTTP.

A discriminative model (a `*ForSequenceClassification` checkpoint) is served by SGLang as a
pooling model: POST /classify with a batch of token-id rows answers one `embedding` per row, the
classification head's logits at the row's last token (SGLang pools the last position; Hugging
Face pools the last non-padding one: a row must not end in the pad id, reward/model_scorer.py
sends no end token). A generative judge is an ordinary generation server: its verdict is one
greedy /generate call through the engine's own client (SGLang or vLLM).

Both calls only read, so both are repeated after a timeout or a transient answer (502/503/504, a
dropped connection) under the reward model's retry policy, up to its deadline; a refused
connection is not (the server is gone: the scorer tries another one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from areal_jobs.api import GenerateRequest, Health, RewardScorer
from areal_jobs.config import JobConfig, RewardModelConfig, RewardModelKind, RolloutEngine
from areal_jobs.rollout.engine_http import EngineHTTP, ServerCallError
from areal_jobs.rollout.engines import make_client
from areal_jobs.transport import discovery
from areal_jobs.transport.retry import RetryPolicy, RoundTrips, call_with_retry

logger = logging.getLogger(__name__)
_REFRESH_S = 1.0  # how often the pool re-reads the registrations (a restarted server's new port)


def scoring_retry(cfg: RewardModelConfig) -> RetryPolicy:
    """The first attempt waits request_timeout_s, each later one twice as long, none after deadline_s."""
    return RetryPolicy(
        first_timeout_s=cfg.request_timeout_s,
        deadline_s=cfg.deadline_s,
        backoff_s=cfg.backoff_s,
        max_backoff_s=cfg.max_backoff_s,
        max_timeout_s=cfg.deadline_s,
    )


def parse_classify(payload: object, rows: int) -> list[list[float]]:
    """Pure: SGLang /classify JSON (a list of {"embedding": [...]}, one per row) -> logits rows."""
    items = payload if isinstance(payload, list) else [payload]
    if len(items) != rows or not all(isinstance(i, dict) and "embedding" in i for i in items):
        raise ValueError(f"/classify answered {str(payload)[:200]!r} for {rows} rows")
    return [[float(x) for x in item["embedding"]] for item in items]


class ScoringClient:
    """One reward-model server. Implements api.ScoringClient."""

    def __init__(
        self, engine: RolloutEngine, name: str, url: str, api_key: str, cfg: RewardModelConfig
    ) -> None:
        self.name = name
        self.engine = engine
        self.retry = scoring_retry(cfg)
        self._http = EngineHTTP(
            name, url, api_key, generate_timeout_s=cfg.request_timeout_s,
            call_timeout_s=cfg.request_timeout_s, retry=self.retry,
        )  # fmt: skip
        # the judge generates through the engine's own client (its /generate body and parser)
        self._engine = make_client(
            engine, name, url, api_key,
            generate_timeout_s=cfg.request_timeout_s, call_timeout_s=cfg.request_timeout_s,
        )  # fmt: skip
        self._judge_trips = RoundTrips()

    async def classify(self, batch: Sequence[Sequence[int]]) -> list[list[float]]:
        if self.engine is not RolloutEngine.sglang:
            raise ValueError("reward.model.kind=discriminative needs reward.model.engine=sglang")
        payload = await self._http.control("/classify", {"input_ids": [list(map(int, row)) for row in batch]})
        return parse_classify(payload, len(batch))

    async def judge(self, rid: str, input_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        request = GenerateRequest(rid, list(input_ids), max_new_tokens, temperature=0.0)
        n = 0

        async def attempt(timeout_s: float) -> list[int]:
            # a repeat is a read under a fresh request id: the first one's late answer is dropped
            nonlocal n
            n += 1
            response = await self._engine.generate(dataclasses.replace(request, rid=f"{rid}.{n}"))
            return list(response.output_ids)

        return await call_with_retry(
            f"/generate#judge on reward server {self.name}", attempt, self.retry,
            lambda exc: isinstance(exc, ServerCallError) and exc.transient, round_trips=self._judge_trips,
        )  # fmt: skip

    async def health(self) -> Health:
        return await self._http.health()

    async def close(self) -> None:
        await self._http.close()
        await self._engine.close()


class ScoringPool:
    """The reward-model servers registered in RUN_DIR/reward_servers/, re-read at most once a
    second: a server restarted after a crash (launch.local, the SLURM supervisor) registers again
    under its index, maybe on a new port, and is used from then on; one that unregistered is not."""

    def __init__(self, discover: Callable[[], list[discovery.ServerRecord]], make: Callable[[discovery.ServerRecord], ScoringClient],
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self._discover = discover
        self._make = make
        self._clock = clock
        self._clients: dict[int, tuple[str, ScoringClient]] = {}
        self._retired: list[ScoringClient] = []
        self._read_at = float("-inf")

    def current(self) -> list[ScoringClient]:
        if self._clock() - self._read_at >= _REFRESH_S:
            self._read_at = self._clock()
            try:
                records = {r.index: r for r in self._discover()}
            except (OSError, ValueError) as exc:  # a half-written record: the next read sees it whole
                logger.warning("reward-model servers: %s", exc)
                records = None
            if records is not None:
                for index in list(self._clients):
                    url, client = self._clients[index]
                    if index not in records or records[index].url != url:
                        self._retired.append(client)
                        del self._clients[index]
                for index, record in records.items():
                    if index not in self._clients:
                        self._clients[index] = (record.url, self._make(record))
        return [client for _, client in self._clients.values()]

    async def close(self) -> None:
        for client in [*self._retired, *(c for _, c in self._clients.values())]:
            await client.close()
        self._clients.clear()
        self._retired.clear()


def build_model_scorer(
    cfg: JobConfig, run_dir: Path, token: str, verifier: RewardScorer, start_s: float
) -> tuple[RewardScorer, ScoringPool]:
    """reward.source=model|combined: wait for the reward-model servers, then the scorer that mixes
    the model's score with the verifier's reward (reward/combined.py)."""
    from areal_jobs.data.chat import chat_renderer
    from areal_jobs.data.tokenizer import load_tokenizer
    from areal_jobs.reward import registry
    from areal_jobs.reward.combined import CombinedScorer
    from areal_jobs.reward.model_scorer import ModelScorer

    rm = cfg.reward.model
    folder = discovery.REWARD_SERVERS
    records = discovery.wait_for_servers(run_dir, rm.num_servers, start_s, folder=folder)
    logger.info("reward-model servers: %s", ", ".join(r.url for r in records))

    def make(record: discovery.ServerRecord) -> ScoringClient:
        return ScoringClient(rm.engine, f"rm{record.index}", record.url, token, rm)

    pool = ScoringPool(lambda: discovery.read_servers(run_dir, folder), make)
    tokenizer = load_tokenizer(rm.path)
    chat_encode = None
    render = chat_renderer(rm.path, add_generation_prompt=rm.kind is RewardModelKind.generative)
    if render is not None:

        def chat_encode(messages: list[dict[str, str]]) -> list[int]:
            return tokenizer.encode(render(messages))

    config = json.loads((Path(rm.path) / "config.json").read_text())
    model = ModelScorer(
        rm, pool.current, tokenizer.encode, tokenizer.decode, chat_encode,
        max_input_tokens=int(config.get("max_position_embeddings") or 0),
    )  # fmt: skip
    return CombinedScorer(cfg.reward, model, verifier, registry.has_checker), pool
