"""Scores answers with a reward model served on its own servers (reward.model.*): api.RewardScorer.

    answers ──▶ model inputs ──▶ batches of reward.model.batch_size ──▶ least-busy server
      (prompt + response,           (discriminative: one /classify per batch;
       or the judge's rubric)        a judge: one greedy /generate per answer)

Every answer has one deadline (reward.model.deadline_s, from when its call first goes out). A
call that fails is repeated on its server while the failure is transient (the client's retry
policy), then tried on another server; with no server up (one restarting after a crash) the
scorer waits for one to register. An answer whose call outlives the deadline, whose input does
not fit the model's context, or whose verdict cannot be read gets RewardStatus.model_error: it is
counted (reward/model_*) and left out of training, never scored as 0.

The servers, the model's tokenizer and the chat template are injected (rollout/main.py builds
them): this module does no I/O of its own and imports neither an engine nor a tokenizer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence

from areal_jobs.api import RewardRequest, RewardResult, RewardStatus, ScoringClient
from areal_jobs.config import RewardModelConfig, RewardModelInput, RewardModelKind, ScoreTransform
from areal_jobs.reward.verdict import VerdictReader, load_template, render

logger = logging.getLogger(__name__)

_NO_SERVER_POLL_S = 1.0
_DETAIL_CHARS = 200


class ModelScorer:
    """A reward model's scorer (satisfies api.RewardScorer).

    `servers()`: the reward-model servers up now. `encode` / `decode`: the reward model's
    tokenizer (text -> ids without special tokens, ids -> text). `chat_encode(messages)`: its chat
    template applied and tokenised (reward.model.input=chat, reward.model.judge_chat=true).
    `max_input_tokens`: the model's context (0 = not stated)."""

    def __init__(
        self,
        cfg: RewardModelConfig,
        servers: Callable[[], Sequence[ScoringClient]],
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        chat_encode: Callable[[list[dict[str, str]]], list[int]] | None = None,
        max_input_tokens: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self._servers = servers
        self._encode = encode
        self._decode = decode
        self._chat_encode = chat_encode
        self._max_input_tokens = max_input_tokens
        self._clock = clock
        self._reader = VerdictReader(cfg)
        self._template = load_template(cfg.judge_template) if cfg.kind is RewardModelKind.generative else ""
        needs_chat = (cfg.kind is RewardModelKind.discriminative and cfg.input is RewardModelInput.chat) or (
            cfg.kind is RewardModelKind.generative and cfg.judge_chat
        )
        if needs_chat and chat_encode is None:
            raise ValueError(
                f"reward.model.path={cfg.path} has no chat template: set reward.model.input=raw "
                "and reward.model.judge_chat=false"
            )
        self._in_flight: dict[str, int] = {}
        self._rids = itertools.count()
        self._counts = {
            k: 0 for k in ("answers", "ok", "timeouts", "errors", "unparsed", "too_long", "calls")
        }
        self._score_sum = 0.0
        self._latency_sum_s = 0.0
        self._busy_s = 0.0  # wall time with at least one call out (the throughput's denominator)
        self._busy_since: float | None = None
        self._outstanding = 0

    # ------------------------------------------------------------------ scoring

    async def score_group(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        """One result per request, in order; never raises for a failed model call."""
        results: list[RewardResult | None] = [None] * len(requests)
        inputs: list[tuple[int, list[int]]] = []
        for i, request in enumerate(requests):
            ids, why = self._input(request)
            if ids is None:
                results[i] = self._failed("too_long", why)
            else:
                inputs.append((i, ids))
        if self.cfg.kind is RewardModelKind.discriminative:
            size = self.cfg.batch_size
            batches = [inputs[k : k + size] for k in range(0, len(inputs), size)]
            scored = await asyncio.gather(*(self._classify([ids for _, ids in b]) for b in batches))
            for batch, batch_results in zip(batches, scored, strict=True):
                for (i, _), result in zip(batch, batch_results, strict=True):
                    results[i] = result
        else:
            judged = await asyncio.gather(*(self._judge(ids, requests[i].response) for i, ids in inputs))
            for (i, _), result in zip(inputs, judged, strict=True):
                results[i] = result
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _input(self, request: RewardRequest) -> tuple[list[int] | None, str]:
        """The model's input ids, or (None, why) when they do not fit its context."""
        cfg = self.cfg
        if cfg.kind is RewardModelKind.discriminative:
            if cfg.input is RewardModelInput.chat:
                ids = self._chat_encode(
                    [
                        {"role": "user", "content": request.prompt},
                        {"role": "assistant", "content": request.response},
                    ]
                )
            else:  # as the policy produced them: prompt, then answer, each tokenised on its own
                ids = self._encode(request.prompt) + self._encode(request.response)
            room = self._max_input_tokens
        else:
            text = render(self._template, request.prompt, request.response, request.reference)
            ids = (
                self._chat_encode([{"role": "user", "content": text}])
                if cfg.judge_chat
                else self._encode(text)
            )
            room = self._max_input_tokens - cfg.judge_max_new_tokens if self._max_input_tokens else 0
        if not ids:
            return None, "empty reward-model input"
        if room and len(ids) > room:
            return None, f"reward-model input of {len(ids)} tokens exceeds the {room} it can read"
        return ids, ""

    async def _classify(self, batch: list[list[int]]) -> list[RewardResult]:
        start = self._clock()
        try:
            logits = await self._call(lambda client: client.classify(batch))
        except TimeoutError:
            return [
                self._failed("timeouts", f"no score within reward.model.deadline_s={self.cfg.deadline_s:g}")
            ] * len(batch)
        except Exception as exc:  # noqa: BLE001  any failure of the remote call fails these rewards
            return [self._failed("errors", f"reward model call failed: {exc}")] * len(batch)
        per_answer_s = self._clock() - start
        results = []
        for row in logits:
            if self.cfg.label >= len(row):
                results.append(
                    self._failed(
                        "errors", f"the model has {len(row)} labels; reward.model.label={self.cfg.label}"
                    )
                )
                continue
            logit = row[self.cfg.label]
            score = 1.0 / (1.0 + math.exp(-logit)) if self.cfg.transform is ScoreTransform.sigmoid else logit
            # 9 significant digits: the served float32 logit exactly (a float32 round-trips at 9)
            results.append(self._scored(score, per_answer_s, f"logit {logit:.9g}"))
        return results

    async def _judge(self, ids: list[int], response: str) -> RewardResult:
        start = self._clock()
        rid = f"judge-{next(self._rids)}"
        try:
            out = await self._call(lambda client: client.judge(rid, ids, self.cfg.judge_max_new_tokens))
        except TimeoutError:
            return self._failed(
                "timeouts", f"no verdict within reward.model.deadline_s={self.cfg.deadline_s:g}"
            )
        except Exception as exc:  # noqa: BLE001
            return self._failed("errors", f"judge call failed: {exc}")
        verdict = self._decode(out)
        score, why = self._reader.score(verdict, response)
        if score is None:
            return self._failed(
                "unparsed", f"{why} (reward.model.parser={self.cfg.parser.value}): {verdict[:80]!r}"
            )
        return self._scored(score, self._clock() - start, why or f"verdict {verdict[:60]!r}")

    async def _call(self, send):
        """`send(client)` on the least busy server up; after a failure on the next one, and once
        every server up has failed, again after a pause (a crashed server comes back under the
        same index), until the deadline: then the last failure, or TimeoutError."""
        deadline = self._clock() + self.cfg.deadline_s
        self._begin()
        try:
            tried: set[str] = set()
            last: BaseException | None = None
            while (left := deadline - self._clock()) > 0:
                fresh = [c for c in self._servers() if c.name not in tried]
                if not fresh:  # none up, or all failed this call: wait, then try them again
                    tried.clear()
                    await asyncio.sleep(min(_NO_SERVER_POLL_S, left))
                    continue
                client = min(fresh, key=lambda c: self._in_flight.get(c.name, 0))
                tried.add(client.name)
                self._in_flight[client.name] = self._in_flight.get(client.name, 0) + 1
                self._counts["calls"] += 1
                try:
                    return await asyncio.wait_for(send(client), timeout=left)
                except TimeoutError:
                    raise
                except Exception as exc:  # noqa: BLE001  tried on the next server
                    if isinstance(exc, ValueError) or getattr(exc, "is_client_error", False):
                        raise  # the request or the answer is wrong, not the server: no repeat helps
                    logger.warning("reward server %s: %s", client.name, str(exc)[:300])
                    last = exc
                finally:
                    self._in_flight[client.name] -= 1
            raise last if last is not None else TimeoutError("no reward-model server up before the deadline")
        finally:
            self._end()

    # ------------------------------------------------------------------ bookkeeping

    def _begin(self) -> None:
        if self._outstanding == 0:
            self._busy_since = self._clock()
        self._outstanding += 1

    def _end(self) -> None:
        self._outstanding -= 1
        if self._outstanding == 0 and self._busy_since is not None:
            self._busy_s += self._clock() - self._busy_since
            self._busy_since = None

    def _scored(self, score: float, latency_s: float, detail: str) -> RewardResult:
        self._counts["answers"] += 1
        self._counts["ok"] += 1
        self._score_sum += score
        self._latency_sum_s += latency_s
        return RewardResult(score, RewardStatus.ok, detail[:_DETAIL_CHARS])

    def _failed(self, kind: str, detail: str) -> RewardResult:
        self._counts["answers"] += 1
        self._counts[kind] += 1
        return RewardResult(0.0, RewardStatus.model_error, detail[:_DETAIL_CHARS])

    def metrics(self) -> dict[str, float]:
        c = self._counts
        busy = self._busy_s + (self._clock() - self._busy_since if self._busy_since is not None else 0.0)
        return {
            "reward/model_answers": float(c["answers"]),
            "reward/model_ok": float(c["ok"]),
            "reward/model_timeouts": float(c["timeouts"]),
            "reward/model_errors": float(c["errors"]),
            "reward/model_unparsed": float(c["unparsed"]),
            "reward/model_too_long": float(c["too_long"]),
            "reward/model_failed": float(c["answers"] - c["ok"]),
            "reward/model_calls": float(c["calls"]),
            "reward/model_score_mean": self._score_sum / c["ok"] if c["ok"] else 0.0,
            "reward/model_latency_s": self._latency_sum_s / c["ok"] if c["ok"] else 0.0,
            "reward/model_busy_s": busy,
            "reward/model_answers_per_busy_s": c["ok"] / busy if busy > 0 else 0.0,
        }
