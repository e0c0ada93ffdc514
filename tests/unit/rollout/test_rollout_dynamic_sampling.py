"""DAPO dynamic sampling in the controller: all-equal-reward groups are dropped AND replaced by
new prompts (every batch still has B groups with signal), counted, and bounded."""

from __future__ import annotations

import asyncio

from areal_jobs.api import RewardResult
from areal_jobs.config import AlgoConfig, RolloutConfig
from areal_jobs.rollout.controller import RolloutController
from areal_jobs.rollout.server_pool import ServerPool

from .fake_server import FakeServer
from .test_rollout_controller_logic import Stream, until


def make(scorer, **algo):
    pool = ServerPool()
    # prompt i is [i+1, i+2, i+3]: even i answers 4 tokens, odd i 3 tokens
    pool.add(0, FakeServer("a", answer_len=lambda ids: 6 + ids[0] % 2))
    pushed = []

    async def push(g):
        pushed.append(g)

    ctl = RolloutController(
        RolloutConfig(max_new_tokens=16, max_concurrent=64),
        AlgoConfig(batch_size=2, group_size=2, max_staleness=0, filter_uniform_groups=True, **algo),
        pool, scorer, Stream(), decode=lambda ids: "!" if len(ids) == 4 else "x", push=push,
    )  # fmt: skip
    return ctl, pushed


def test_uniform_groups_are_replaced_and_counted():
    class Scorer:
        async def score_group(self, requests):
            signal = requests[0].response == "!"  # even data index: rewards 0, 1
            return [RewardResult(float(i % 2) if signal else 0.0) for i in range(len(requests))]

        def metrics(self):
            return {}

    async def go():
        ctl, pushed = make(Scorer())
        task = asyncio.create_task(ctl.admission_loop())
        await until(lambda: len(pushed) == 2)  # eta = 0: exactly B groups with signal at version 0
        await asyncio.sleep(0.2)
        await ctl.stop()
        task.cancel()
        return ctl, pushed

    ctl, pushed = asyncio.run(go())
    assert len(pushed) == 2
    for g in pushed:
        assert len({s.reward for s in g.samples}) == 2  # every trained group has signal
    # prompts 0 and 1 start; 1 has no signal and frees its slot, so prompt 2 replaces it
    assert sorted(g.data_index for g in pushed) == [0, 2]
    assert ctl.counters.discarded_groups == 1
    assert ctl.metrics()["buffer/discarded_groups"] == float(ctl.counters.discarded_groups)
    assert ctl.staleness.state.accepted == 2 and ctl.fatal is None


def test_too_many_uniform_groups_in_a_row_is_an_error():
    class AllZero:
        async def score_group(self, requests):
            return [RewardResult(0.0) for _ in requests]

        def metrics(self):
            return {}

    async def go():
        ctl, pushed = make(AllZero(), max_discarded_groups=3)
        task = asyncio.create_task(ctl.admission_loop())
        await until(lambda: ctl.fatal is not None)
        await ctl.stop()
        task.cancel()
        return ctl, pushed

    ctl, pushed = asyncio.run(go())
    assert pushed == []
    # two groups run at once: the one after the third discard may finish before the run stops
    assert "algo.max_discarded_groups" in str(ctl.fatal) and ctl.counters.discarded_groups >= 3
