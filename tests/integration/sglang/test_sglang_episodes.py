"""Multi-turn episodes (rollout/workflow=multi_turn_math) against the real SGLang server of the
session (tests/integration/sglang/conftest.py; no second engine start): the loss mask covers
exactly the model's tokens, the trainer's fp32 log-probs match the server's on every model token,
a weight update that lands inside turn 2 (at a chosen token, from a hook: no timing) continues
the episode under v + 1 with per-token versions, and a checkpoint taken inside turn 2 resumes in
a fresh controller, replaying turn 1 and continuing turn 2 from its saved tokens.

The session's tiny model is randomly initialised (tests/conftest.py), so its turns mostly run to
the token limit and every answer is wrong: each episode has max_turns = 3 model turns. Each test
first publishes the original weights as version 0 (another file may have changed them; the
controllers start at version 0 too, so staleness admits one group of batch 1 at a time).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import numpy as np
import pytest
import torch
from sglang_harness import Broadcaster

from areal_jobs.agent.context import EpisodeText
from areal_jobs.agent.multi_turn_math import FEEDBACK
from areal_jobs.api import FinishReason, GenerateResponse, RewardResult
from areal_jobs.config import (
    Advantage,
    AlgoConfig,
    DataConfig,
    DType,
    RolloutConfig,
    TrainerConfig,
    WorkflowConfig,
)
from areal_jobs.data.chat import PromptFormat
from areal_jobs.data.prompts import PromptStream, eval_prompts
from areal_jobs.data.tokenizer import load_tokenizer
from areal_jobs.rollout.controller import RolloutController
from areal_jobs.rollout.snapshot import load_snapshot, save_snapshot
from areal_jobs.trainer.forward.hf_logprobs import token_logprobs
from areal_jobs.trainer.intake.batch import TrainSample
from areal_jobs.trainer.torch.backend import TorchBackend

pytestmark = pytest.mark.sglang

MAX_NEW = 40  # per turn
CUT = 5  # turn 2's first segment is cut after this many tokens (the update / checkpoint lands there)


class Recording:
    """The pool's SGLang client: records every /generate; `hook(inner, request)` may answer instead."""

    def __init__(self, inner, hook=None):
        self.inner, self.hook, self.calls = inner, hook, []
        self.name = inner.name

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request):
        response = await self.hook(self.inner, request) if self.hook else None
        if response is None:
            response = await self.inner.generate(request)
        self.calls.append((request, response))
        return response


class WrongScorer:
    async def score_group(self, requests):
        return [RewardResult(0.0) for _ in requests]

    def metrics(self):
        return {}


@pytest.fixture(scope="module")
def world(tiny_model_dir):
    backend = TorchBackend(TrainerConfig(), AlgoConfig(), str(tiny_model_dir), DType.float32)
    backend.setup()
    backend.model.eval()
    tok = load_tokenizer(tiny_model_dir)
    data = DataConfig(num_eval_prompts=4)
    text = EpisodeText(
        tok.encode, tok.decode, tok.decode_raw, PromptFormat.load(data, tiny_model_dir).message_texts
    )
    return {
        "backend": backend,
        "weights": dict(backend.iter_weights()),
        "tok": tok,
        "text": text,
        "prompt": eval_prompts(data, tok.encode)[0],
        "feedback": text.encode(text.message_texts("user", FEEDBACK)[1]),
    }


def controller(world, pool, group_size, temperature, pushed):
    stream = PromptStream(DataConfig(), world["tok"].encode)
    stream.at = lambda i: dataclasses.replace(world["prompt"], data_index=i)  # always the same prompt

    async def push(group):
        pushed.append(group)

    algo = AlgoConfig(
        batch_size=1, group_size=2, max_staleness=0, advantage=Advantage.drgrpo, ppo_minibatches=1
    )
    # one-answer groups follow one episode through the controller; no advantage is computed here,
    # so the group size a training run must not use (AlgoConfig refuses 1) is set after validation
    algo.group_size = group_size
    return RolloutController(
        RolloutConfig(max_new_tokens=MAX_NEW, temperature=temperature, workflow=WorkflowConfig(name="multi_turn_math")),
        algo, pool, WrongScorer(), stream, world["tok"].decode, push,
        stop_token_ids=world["tok"].stop_token_ids, text=world["text"],
    )  # fmt: skip


async def run_until_pushed(ctl, pushed, restored=None):
    if restored is not None:
        ctl.version = restored.version
        ctl.restore(restored)
    admission = asyncio.create_task(ctl.admission_loop())
    for _ in range(3000):
        if any(g.data_index == 0 for g in pushed) or ctl.fatal is not None:
            break
        await asyncio.sleep(0.1)
    await ctl.stop()
    admission.cancel()
    assert ctl.fatal is None, ctl.fatal
    return next(g for g in pushed if g.data_index == 0)


@pytest.fixture(scope="module")
def sampled(sglang_server, world):
    """Four 3-turn episodes at temperature 1, with every server answer recorded."""

    async def go():
        caster = Broadcaster(sglang_server)
        try:
            await caster.publish(world["weights"], version=0)
            client = Recording(caster.pool.slots[0].client)
            caster.pool.slots[0].client = client
            pushed = []
            group = await run_until_pushed(controller(world, caster.pool, 4, 1.0, pushed), pushed)
            return group, client.calls
        finally:
            await caster.close()

    return asyncio.run(go())


def test_a_3_turn_episode_masks_exactly_the_model_tokens(sampled, world):
    group, calls = sampled
    prompt, feedback = world["prompt"].input_ids, world["feedback"]
    for s in group.samples:
        turns = [resp.output_ids for req, resp in calls if s.sample_id in req.rid]
        assert len(turns) == 3 and s.num_turns == 3  # no update here: one request per turn
        assert s.output_ids.tolist() == turns[0] + feedback + turns[1] + feedback + turns[2]
        mask = (
            [1] * len(turns[0])
            + [0] * len(feedback)
            + [1] * len(turns[1])
            + [0] * len(feedback)
            + [1] * len(turns[2])
        )
        assert s.loss_mask.tolist() == mask
        # each turn was sent as prompt + every episode token before it (token-exact concatenation)
        inputs = [req.input_ids for req, resp in calls if s.sample_id in req.rid]
        assert (
            inputs[1] == prompt + turns[0] + feedback
            and inputs[2] == prompt + s.output_ids.tolist()[: -len(turns[2])]
        )
        assert np.all(s.logprobs[s.loss_mask == 0] == 0.0) and s.versions.tolist() == [0] * s.num_tokens


def test_trainer_logprobs_match_the_server_on_every_model_token(sampled, world, record_property):
    group, _ = sampled
    samples = [
        TrainSample(s.sample_id, np.concatenate([group.prompt_ids, s.output_ids]).astype(np.int64),
                    int(group.prompt_ids.shape[0]), s.logprobs, s.versions, 0.0, 0.0, loss_mask=s.loss_mask)
        for s in group.samples
    ]  # fmt: skip
    with torch.no_grad():
        recomputed = token_logprobs(world["backend"].model, samples)
    model = np.concatenate([s.loss_mask.astype(bool) for s in samples])
    diff = np.abs(torch.cat(recomputed).numpy() - np.concatenate([s.behav_logprobs for s in samples]))[model]
    record_property("episode_logprob_mean_abs_diff", float(diff.mean()))
    record_property("episode_logprob_max_abs_diff", float(diff.max()))
    print(
        f"\nepisode log-prob |server - trainer| over {diff.size} model tokens: max {diff.max():.2e}, mean {diff.mean():.2e}"
    )
    assert diff.size == sum(int(s.loss_mask.sum()) for s in group.samples) > 100
    assert diff.mean() < 1e-3 and diff.max() < 1e-2


def cut_turn_2(request) -> bool:
    return request.rid.endswith("-t1.0")  # turn index 1 (the second turn), segment 0


def test_an_update_inside_turn_2_continues_the_episode_under_the_new_version(sglang_server, world):
    async def go():
        caster = Broadcaster(sglang_server)
        await caster.publish(world["weights"], version=0)
        pushed, updates = [], []

        async def update():
            await caster.publish(world["weights"], version=1)  # the real handshake, same weights
            ctl.on_version(1)
            ctl.running.set()

        async def hook(inner, request):
            if updates or not cut_turn_2(request):  # once: later groups run on untouched
                return None
            r = await inner.generate(dataclasses.replace(request, max_new_tokens=CUT))
            assert r.finish_reason is FinishReason.length and r.weight_version == 0
            ctl.running.clear()  # the controller sends nothing until the update is done
            updates.append(asyncio.create_task(update()))
            return GenerateResponse(r.output_ids, r.logprobs, FinishReason.abort, r.weight_version)

        client = Recording(caster.pool.slots[0].client, hook)
        caster.pool.slots[0].client = client
        ctl = controller(world, caster.pool, 1, 1e-5, pushed)
        try:
            group = await run_until_pushed(ctl, pushed)
            await asyncio.gather(*updates)
        finally:
            await caster.close()
        return group, client.calls

    group, calls = asyncio.run(go())
    (s,) = group.samples
    turn_1 = calls[0][1].output_ids
    before = len(turn_1) + len(world["feedback"]) + CUT  # turn 1, the feedback, turn 2's first CUT tokens
    assert s.num_interruptions == 1 and s.num_turns == 3
    assert s.versions.tolist() == [0] * before + [1] * (s.num_tokens - before)
    continuation = next(req for req, _ in calls if req.rid.endswith("-t1.1"))
    assert continuation.input_ids == world["prompt"].input_ids + s.output_ids.tolist()[:before]
    assert continuation.cache_salt == "v1" and continuation.max_new_tokens == MAX_NEW - CUT


def test_a_checkpoint_inside_turn_2_resumes_in_a_fresh_controller(sglang_server, world, tmp_path):
    async def first():
        caster = Broadcaster(sglang_server)
        await caster.publish(world["weights"], version=0)
        pushed, snaps = [], []

        async def hook(inner, request):
            if cut_turn_2(request):
                r = await inner.generate(dataclasses.replace(request, max_new_tokens=CUT))
                return GenerateResponse(r.output_ids, r.logprobs, FinishReason.abort, r.weight_version)
            if request.rid.endswith("-t1.1"):  # turn 2 holds its first CUT tokens: checkpoint now
                snaps.append(ctl.snapshot(step=7))
            return None

        caster.pool.slots[0].client = Recording(caster.pool.slots[0].client, hook)
        ctl = controller(world, caster.pool, 1, 1e-5, pushed)
        try:
            return await run_until_pushed(ctl, pushed), snaps[0]
        finally:
            await caster.close()

    reference, snap = asyncio.run(first())
    save_snapshot(snap, tmp_path)
    loaded = load_snapshot(tmp_path)
    saved = copy.deepcopy(loaded.partial[0].samples[0])  # the resumed controller goes on in place
    assert [e[0] for e in saved.events] == ["model", "env", "model"] and saved.events[-1][3] == ""
    assert saved.events[-1][2] - saved.events[-1][1] == CUT

    async def second():
        caster = Broadcaster(sglang_server)
        await caster.publish(world["weights"], version=0)
        client = Recording(caster.pool.slots[0].client)
        caster.pool.slots[0].client = client
        pushed = []
        try:
            return await run_until_pushed(
                controller(world, caster.pool, 1, 1e-5, pushed), pushed, loaded
            ), client.calls
        finally:
            await caster.close()

    resumed, calls = asyncio.run(second())
    (ref,), (s,) = reference.samples, resumed.samples
    prompt = world["prompt"].input_ids
    # turn 1 was replayed, not generated again; turn 2 went on from its saved tokens
    assert calls[0][0].input_ids == prompt + saved.output_ids and calls[0][0].max_new_tokens == MAX_NEW - CUT
    assert all(req.input_ids != prompt for req, _ in calls)
    assert s.output_ids[: len(saved.output_ids)].tolist() == saved.output_ids
    assert s.num_turns == 3 and s.loss_mask.tolist() == ref.loss_mask.tolist()
    assert s.output_ids.tolist() == ref.output_ids.tolist()  # greedy: the same episode as without the cut
