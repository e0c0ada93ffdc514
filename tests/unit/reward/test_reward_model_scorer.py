"""The reward-model scorer's logic around its servers (batching, deadlines, failover, failed
verdicts), the verdict parsers, the mixing of sources, and the config's refusals. The servers are
fakes here; tests/integration/sglang/test_sglang_reward_model.py runs the real ones."""

from __future__ import annotations

import asyncio
import math

import pytest

from areal_jobs.api import RewardRequest, RewardResult, RewardStatus
from areal_jobs.config import (
    RewardConfig,
    RewardModelConfig,
    RewardModelKind,
    RewardSource,
    RolloutEngine,
    ScoreTransform,
    VerdictParser,
)
from areal_jobs.reward.combined import CombinedScorer
from areal_jobs.reward.model_scorer import ModelScorer
from areal_jobs.reward.verdict import VerdictReader, render


class Refused(RuntimeError):
    refused = True


class FakeServer:
    """A reward-model server: logit = number of ids; a judge echoes `verdict`; `fail` calls fail."""

    def __init__(self, name: str, fail: int = 0, verdict: str = "Score: 7", hang: bool = False) -> None:
        self.name, self.fail, self.verdict, self.hang = name, fail, verdict, hang
        self.batches: list[int] = []

    async def classify(self, batch):
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail:
            self.fail -= 1
            raise Refused("connection refused")
        self.batches.append(len(batch))
        return [[float(len(row)), -1.0] for row in batch]

    async def judge(self, rid, input_ids, max_new_tokens):
        if self.fail:
            self.fail -= 1
            raise Refused("connection refused")
        return [ord(c) for c in self.verdict]

    async def health(self):
        return None

    async def close(self):
        pass


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def scorer(servers, max_input_tokens: int = 64, **cfg) -> ModelScorer:
    return ModelScorer(
        RewardModelConfig(path="rm", **cfg),
        lambda: servers,
        encode,
        decode,
        max_input_tokens=max_input_tokens,
    )


def requests(*answers: str, prompt: str = "Q") -> list[RewardRequest]:
    return [RewardRequest("arith", a, "3", prompt) for a in answers]


def test_discriminative_scores_in_batches_of_batch_size_with_the_sigmoid_of_the_logit():
    server = FakeServer("a")
    s = scorer([server], batch_size=2)
    results = asyncio.run(s.score_group(requests("x", "yy", "zzz")))
    assert server.batches == [2, 1]
    # logit = len(prompt ids + answer ids): "Q" + answer
    assert [r.reward for r in results] == [pytest.approx(1 / (1 + math.exp(-n))) for n in (2, 3, 4)]
    assert all(r.status is RewardStatus.ok for r in results)
    raw = asyncio.run(
        scorer([FakeServer("b")], transform=ScoreTransform.raw, label=1).score_group(requests("x"))
    )
    assert raw[0].reward == -1.0  # label 1 of the two logits, untransformed


def test_a_failed_server_is_left_for_another_and_no_reward_is_lost():
    bad, good = FakeServer("bad", fail=5), FakeServer("good")
    s = scorer([bad, good])
    s._in_flight["good"] = 1  # the bad one looks least busy: it is tried first
    results = asyncio.run(s.score_group(requests("x")))
    assert results[0].status is RewardStatus.ok and good.batches == [1]
    assert s.metrics()["reward/model_calls"] == 2.0


def test_past_the_deadline_the_reward_fails_never_a_zero():
    s = scorer([FakeServer("slow", hang=True)], request_timeout_s=0.05, deadline_s=0.2)
    (result,) = asyncio.run(s.score_group(requests("x")))
    assert result.status is RewardStatus.model_error and "deadline" in result.detail
    m = s.metrics()
    assert (
        m["reward/model_timeouts"] == 1.0 and m["reward/model_failed"] == 1.0 and m["reward/model_ok"] == 0.0
    )


def test_servers_that_keep_failing_fail_the_reward_at_the_deadline():
    s = scorer([FakeServer("a", fail=10**6)], request_timeout_s=0.05, deadline_s=0.3, backoff_s=0.0)
    (result,) = asyncio.run(s.score_group(requests("x")))
    assert result.status is RewardStatus.model_error and "refused" in result.detail
    assert s.metrics()["reward/model_errors"] == 1.0


def test_with_no_server_up_the_scorer_waits_for_one_to_register():
    servers: list[FakeServer] = []
    s = scorer(servers, request_timeout_s=1.0, deadline_s=5.0)

    async def main():
        task = asyncio.create_task(s.score_group(requests("x")))
        await asyncio.sleep(0.2)
        assert not task.done()
        servers.append(FakeServer("restarted"))  # a restarted server registers again
        return await task

    (result,) = asyncio.run(main())
    assert result.status is RewardStatus.ok


def test_an_input_beyond_the_context_fails_that_answer_only():
    results = asyncio.run(scorer([FakeServer("a")]).score_group(requests("x" * 100, "ok")))
    assert results[0].status is RewardStatus.model_error and "exceeds" in results[0].detail
    assert results[1].status is RewardStatus.ok


def test_judge_verdicts_are_parsed_and_an_unreadable_one_fails():
    cfg = dict(kind=RewardModelKind.generative, judge_max_new_tokens=8, max_input_tokens=1024)
    ok = asyncio.run(scorer([FakeServer("a", verdict="Score: 7")], **cfg).score_group(requests("4")))
    assert ok[0].reward == pytest.approx(0.7) and ok[0].status is RewardStatus.ok
    s = scorer([FakeServer("a", verdict="I cannot tell")], **cfg)
    bad = asyncio.run(s.score_group(requests("4")))
    assert bad[0].status is RewardStatus.model_error and "no score" in bad[0].detail
    assert s.metrics()["reward/model_unparsed"] == 1.0


def test_verdict_parsers():
    def read(parser, verdict, response="", regex=None):
        cfg = RewardModelConfig(path="rm", parser=parser, **({"verdict_regex": regex} if regex else {}))
        return VerdictReader(cfg).score(verdict, response)[0]

    assert read(VerdictParser.score_regex, "... score = 9.5") == pytest.approx(0.95)
    assert read(VerdictParser.score_regex, "nothing") is None
    assert read(VerdictParser.yes_no, "Yes, it is right.") == 1.0
    assert read(VerdictParser.yes_no, "No, it is not correct") == 0.0  # the first decisive word
    assert read(VerdictParser.yes_no, "maybe") is None
    answer = r"The answer is (-?\d+)\."
    assert (
        read(VerdictParser.answer_match, " 7; a: 7+3=0. The answer is 0.", "The answer is 0.", answer) == 1.0
    )
    assert read(VerdictParser.answer_match, "The answer is 0.", "The answer is 1.", answer) == 0.0
    assert read(VerdictParser.answer_match, "The answer is 0.", "no answer", answer) == 0.0
    assert read(VerdictParser.answer_match, "garbled", "The answer is 0.", answer) is None


def test_template_fields_and_braces_in_the_data():
    assert render("{prompt}|{response}|{reference}", "a {x}", "b}", "c") == "a {x}|b}|c"
    with pytest.raises(ValueError, match="judge_template"):
        render("{question}", "a", "b", "c")


class FixedScorer:
    def __init__(self, results: list[RewardResult]) -> None:
        self.results = results

    async def score_group(self, requests):
        return self.results[: len(requests)]

    def metrics(self):
        return {}


def test_combined_weights_and_failed_model_rewards():
    model = FixedScorer(
        [RewardResult(0.8), RewardResult(0.0, RewardStatus.model_error, "down"), RewardResult(0.9)]
    )
    verifier = FixedScorer([RewardResult(1.0), RewardResult(1.0), RewardResult(0.0)])
    cfg = RewardConfig(source=RewardSource.combined, verifier_weight=0.5, model_weight=2.0,
                       model=RewardModelConfig(path="rm"))  # fmt: skip
    c = CombinedScorer(cfg, model, verifier, lambda task: True)
    out = asyncio.run(c.score_group(requests("a", "b", "c")))
    assert [r.reward for r in out] == [pytest.approx(0.5 + 1.6), 0.0, pytest.approx(1.8)]
    assert [r.status for r in out] == [RewardStatus.ok, RewardStatus.model_error, RewardStatus.ok]
    m = c.metrics()
    # judged by both: answers 1 and 3; the model calls both right, the verifier only the first
    assert (m["reward/model_judged"], m["reward/model_agreed"], m["reward/model_exploited"]) == (
        2.0,
        1.0,
        1.0,
    )
    assert m["reward/model_exploit_rate"] == 0.5 and m["reward/verifier_accuracy"] == pytest.approx(2 / 3)


def test_model_source_trains_on_the_model_and_refuses_combined_without_a_checker():
    model = FixedScorer([RewardResult(0.3)])
    verifier = FixedScorer([RewardResult(1.0)])
    cfg = RewardConfig(source=RewardSource.model, model=RewardModelConfig(path="rm"))
    (r,) = asyncio.run(CombinedScorer(cfg, model, verifier, lambda t: True).score_group(requests("a")))
    assert r.reward == 0.3
    combined = RewardConfig(source=RewardSource.combined, model=RewardModelConfig(path="rm"))
    with pytest.raises(ValueError, match="reward.source=model"):
        asyncio.run(CombinedScorer(combined, model, verifier, lambda t: False).score_group(requests("a")))


@pytest.mark.parametrize(
    ("kwargs", "override"),
    [
        (dict(source=RewardSource.model), "reward.model.path"),
        (dict(source=RewardSource.combined, verifier_weight=0, model_weight=0, model=RewardModelConfig(path="x")), "reward.verifier_weight"),
    ],
)  # fmt: skip
def test_reward_config_refusals_name_the_override(kwargs, override):
    with pytest.raises(ValueError, match=override.replace(".", r"\.")):
        RewardConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "override"),
    [
        (dict(deadline_s=1.0, request_timeout_s=5.0), "reward.model.deadline_s"),
        (dict(kind=RewardModelKind.generative, verdict_regex=r"\d+"), "reward.model.verdict_regex"),
        (dict(kind=RewardModelKind.generative, judge_template="{prompt}"), "reward.model.judge_template"),
        (dict(engine=RolloutEngine.vllm), "reward.model.engine=sglang"),
        (dict(verdict_regex="("), "reward.model.verdict_regex"),
        (dict(batch_size=0), "reward.model.batch_size"),
    ],
)  # fmt: skip
def test_reward_model_config_refusals_name_the_override(kwargs, override):
    with pytest.raises(ValueError, match=override.replace(".", r"\.")):
        RewardModelConfig(**kwargs)
