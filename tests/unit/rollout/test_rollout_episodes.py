"""The controller runs each sample as an episode of the configured workflow (multi_turn_math here)
over its generation path, and a checkpoint taken mid-episode resumes in a fresh controller.

The fake server answers every request up to the next multiple of 40 tokens (prompt + episode so
far), so each episode's tokens are the same however often it is interrupted or resumed."""

from __future__ import annotations

import asyncio

from areal_jobs.agent.context import EpisodeText
from areal_jobs.config import AlgoConfig, RolloutConfig, WorkflowConfig
from areal_jobs.rollout.controller import RolloutController
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.rollout.snapshot import load_snapshot, save_snapshot

from .fake_server import FakeServer, ZeroScorer
from .test_rollout_controller_logic import Stream, until

FEEDBACK = [7, 7]  # what the user's "incorrect, try again" encodes to here


def next_40(ids):
    return (len(ids) // 40 + 1) * 40


def make(server, pushed):
    pool = ServerPool()
    pool.add(0, server)

    async def push(g):
        pushed.append(g)

    rollout = RolloutConfig(
        max_new_tokens=64, max_concurrent=64, workflow=WorkflowConfig(name="multi_turn_math")
    )
    text = EpisodeText(
        lambda s: FEEDBACK, lambda ids: "x", lambda ids: "x", lambda role, content: ("", content)
    )
    return RolloutController(
        rollout, AlgoConfig(batch_size=1, group_size=2, max_staleness=0), pool, ZeroScorer(), Stream(),
        decode=lambda ids: "x", push=push, text=text,
    )  # fmt: skip


def expected_episode(index=0):
    """Three wrong answers (ZeroScorer) of prompt [i+1, i+2, i+3], with the feedback between."""
    out, mask = [], []
    for t in range(3):
        start = 3 + len(out)
        turn = [100 + p for p in range(start, next_40([0] * start))]
        turn[-1] = 0
        out += turn
        mask += [1] * len(turn)
        if t < 2:
            out += FEEDBACK
            mask += [0, 0]
    return out, mask


def test_each_sample_is_a_three_turn_episode_with_its_loss_mask():
    async def go():
        pushed = []
        ctl = make(FakeServer("a", answer_len=next_40), pushed)
        task = asyncio.create_task(ctl.admission_loop())
        await until(lambda: len(pushed) >= 1)
        await ctl.stop()
        task.cancel()
        return pushed[0], ctl

    group, ctl = asyncio.run(go())
    tokens, mask = expected_episode()
    for s in group.samples:
        assert s.output_ids.tolist() == tokens and s.loss_mask.tolist() == mask
        assert (s.num_turns, s.reward, s.finish_reason) == (3, 0.0, "stop")
        assert s.logprobs[mask.index(0)] == 0.0
    assert ctl.metrics()["rollout/turns_per_episode"] == 3.0


def test_a_checkpoint_taken_in_turn_2_resumes_the_episodes_in_a_fresh_controller(tmp_path):
    in_turn_2 = asyncio.Event()

    class Turn2Hook(FakeServer):
        async def generate(self, request):
            if "-t1." in request.rid:
                in_turn_2.set()
            return await super().generate(request)

    async def first():
        pushed = []
        server = Turn2Hook("a", token_s=0.004, answer_len=next_40)
        ctl = make(server, pushed)
        task = asyncio.create_task(ctl.admission_loop())
        await in_turn_2.wait()
        ctl.running.clear()
        await server.pause("abort")
        await asyncio.sleep(0.1)  # the aborted calls return; partial turns land in the episode states
        snap = ctl.snapshot(step=0)
        await ctl.stop()
        task.cancel()
        return snap

    save_snapshot(asyncio.run(first()), tmp_path)
    loaded = load_snapshot(tmp_path)
    episodes = [s for g in loaded.partial if g.data_index == 0 for s in g.samples]
    assert any(s.num_turns >= 2 for s in episodes)
    saved = {s.sample_id: (list(s.output_ids), s.num_turns) for s in episodes}

    async def second():
        pushed = []
        server = FakeServer("a", answer_len=next_40)
        ctl = make(server, pushed)
        ctl.restore(loaded)
        task = asyncio.create_task(ctl.admission_loop())
        await until(lambda: any(g.data_index == 0 for g in pushed))
        await ctl.stop()
        task.cancel()
        return next(g for g in pushed if g.data_index == 0), server

    group, server = asyncio.run(second())
    tokens, mask = expected_episode()
    for s in group.samples:
        assert s.output_ids.tolist() == tokens and s.loss_mask.tolist() == mask and s.num_turns == 3
        output, turns = saved[s.sample_id]
        prompt = [1, 2, 3]
        if turns >= 2:  # turn 1 was replayed (never sent again); turn 2 went on from its saved tokens
            assert not any(r.input_ids == prompt for r in server.requests if s.sample_id in r.rid)
            assert any(r.input_ids == prompt + output for r in server.requests if s.sample_id in r.rid)
