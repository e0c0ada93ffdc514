"""The one generation path (rollout/generation.py) that training samples and evaluation share:
continuation after an interruption, failover, version stamps, and evaluation's pass@k on top of it.
Scripted in-process servers (each call's answer is given in advance), so every value is exact."""

from __future__ import annotations

import asyncio

import pytest

from areal_jobs.api import FinishReason, GenerateRequest, GenerateResponse, RewardResult
from areal_jobs.config import AlgoConfig, RolloutConfig
from areal_jobs.data.prompts import Prompt
from areal_jobs.rollout.controller import RolloutController
from areal_jobs.rollout.engine_http import ServerCallError
from areal_jobs.rollout.evaluation import evaluate_problems
from areal_jobs.rollout.generation import GenerationPath, Sampling
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.rollout.snapshot import PartialSample

STOP, LENGTH, ABORT = FinishReason.stop, FinishReason.length, FinishReason.abort


class Scripted:
    """Answers each /generate with the next scripted item (a response, or an error to raise)."""

    def __init__(self, name, script, healthy=True):
        self.name, self.script, self.is_healthy = name, list(script), healthy
        self.requests: list[GenerateRequest] = []

    async def generate(self, request):
        self.requests.append(request)
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    async def healthy(self):
        return self.is_healthy


def path_over(*clients, version=lambda: 0):
    pool = ServerPool()
    for i, c in enumerate(clients):
        pool.add(i, c)
    running = asyncio.Event()
    running.set()
    return GenerationPath(pool, running, version)


def run(path, state, max_new=10, prompt=(1, 2)):
    asyncio.run(path.run("s", list(prompt), state, Sampling(max_new, temperature=1.0)))
    return state


def test_an_interrupted_answer_is_continued_with_its_partial_output_and_both_versions():
    versions = iter([0, 1])  # the path reads the servers' version once per segment
    server = Scripted(
        "a",
        [GenerateResponse([5, 6], [-0.5, -0.25], ABORT, 0), GenerateResponse([7, 0], [-1.0, -2.0], STOP, 1)],
    )
    path = path_over(server, version=lambda: next(versions))
    state = run(path, PartialSample("s"))
    assert [r.input_ids for r in server.requests] == [[1, 2], [1, 2, 5, 6]]
    assert [r.max_new_tokens for r in server.requests] == [10, 8]
    assert [r.rid for r in server.requests] == ["s.0", "s.1"]
    assert state.output_ids == [5, 6, 7, 0] and state.logprobs == [-0.5, -0.25, -1.0, -2.0]
    assert state.versions == [0, 0, 1, 1] and state.interruptions == 1 and state.finish_reason == "stop"
    assert (path.counters.segments, path.counters.interrupted_requests, path.counters.generated_tokens) == (
        2,
        1,
        4,
    )


def test_a_segment_that_straddles_an_update_keeps_the_older_version():
    # sent at version 3, answered by a server already at 4 (in_place pause): stamped 3
    server = Scripted("a", [GenerateResponse([5], [-1.0], STOP, 4)])
    state = run(path_over(server, version=lambda: 3), PartialSample("s"))
    assert state.versions == [3]


def test_a_dead_server_is_marked_down_and_the_request_moves_with_its_partial_output():
    dead = Scripted("a", [ServerCallError("a", "/generate", "connection reset")], healthy=False)
    alive = Scripted("b", [GenerateResponse([8, 0], [-1.0, -1.0], STOP, 0)])
    path = path_over(dead, alive)
    state = run(path, PartialSample("s", output_ids=[5], logprobs=[-0.1], versions=[0]))
    assert not path.pool.slots[0].up and path.pool.slots[1].up
    assert alive.requests[0].input_ids == [1, 2, 5] and alive.requests[0].max_new_tokens == 9
    assert state.output_ids == [5, 8, 0] and path.counters.server_errors == 1
    assert path.pool.total_in_flight == 0 and path.in_flight == 0


def test_a_dropped_connection_to_a_healthy_server_is_retried_without_marking_it_down():
    server = Scripted(
        "a",
        [ServerCallError("a", "/generate", "reset"), GenerateResponse([0], [-1.0], STOP, 0)],
        healthy=True,
    )
    path = path_over(server)
    state = run(path, PartialSample("s"))
    assert path.pool.slots[0].up and state.output_ids == [0] and len(server.requests) == 2


def test_a_client_error_is_raised_not_failed_over():
    bad = Scripted("a", [ServerCallError("a", "/generate", "bad request", status=400)])
    other = Scripted("b", [])
    path = path_over(bad, other)
    with pytest.raises(ServerCallError):
        run(path, PartialSample("s"))
    assert path.pool.slots[0].up and other.requests == []


def test_an_answer_at_the_token_limit_ends_as_length_without_a_request():
    server = Scripted("a", [])
    state = run(path_over(server), PartialSample("s", output_ids=[1] * 10), max_new=10)
    assert state.finish_reason == "length" and server.requests == []


def test_training_and_evaluation_drive_the_same_path_class():
    pool = ServerPool()
    ctl = RolloutController(
        RolloutConfig(), AlgoConfig(), pool, scorer=None, stream=None, decode=None, push=None
    )  # fmt: skip
    assert type(ctl.generation) is GenerationPath and ctl.generation.counters is ctl.counters


class EndsWithBang:
    async def score_group(self, requests):
        return [RewardResult(1.0 if r.response.endswith("!") else 0.0) for r in requests]


def test_evaluation_scores_n_answers_per_problem_and_fails_over_like_training():
    # problem 0: answers "!", "x", "!", "x" (2 of 4 correct); problem 1: "x" x4 (0 correct).
    # One answer is cut by the token limit (length) and the first call hits a dead server.
    def answer(tok, finish=STOP):
        return GenerateResponse([tok], [-1.0], finish, 7)

    dead = Scripted("a", [ServerCallError("a", "/generate", "refused")], healthy=False)
    script = [answer(1), answer(0), answer(1), answer(0), answer(0), answer(0), answer(0), answer(0, LENGTH)]
    alive = Scripted("b", script)
    path = path_over(dead, alive, version=lambda: 7)
    prompts = [Prompt(-1, [3], "arith", "a"), Prompt(-2, [4], "arith", "b")]
    outcome = asyncio.run(
        evaluate_problems(
            path, EndsWithBang(), prompts, decode=lambda ids: "!" if ids == [1] else "x",
            sampling=Sampling(4, 1.0), samples_per_problem=4, ks=(2, 4), tag="t", concurrency=1,
        )
    )  # fmt: skip
    s = outcome.summary
    assert [p.rewards for p in outcome.problems] == [[1.0, 0.0, 1.0, 0.0], [0.0] * 4]
    assert s.accuracy == pytest.approx((2 / 4 + 0) / 2)
    # pass@2 of problem 0: 1 - C(2,2)/C(4,2) = 5/6; problem 1: 0
    assert s.pass_at_k[2] == pytest.approx(5 / 12) and s.pass_at_k[4] == pytest.approx(0.5)
    assert s.truncation_rate == pytest.approx(1 / 8) and s.mean_length_tokens == 1.0
    assert (s.min_version, s.max_version, s.samples_per_problem) == (7, 7, 4)
    assert not path.pool.slots[0].up and path.counters.server_errors == 1
