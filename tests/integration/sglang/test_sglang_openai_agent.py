"""An agent written only against the `openai` client (examples/arith_agent.py), pointed at the
endpoint in front of the session's real SGLang server (conftest.py; no second engine start),
produces episodes the controller pushes as a TrajectoryGroup and the torch trainer trains on.

The session's tiny model is randomly initialised, so its first answer never ends in "The answer
is N.": the agent asks once more, and every episode has two model turns around the re-ask.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch
from sglang_harness import Broadcaster

from areal_jobs.agent.context import EpisodeText
from areal_jobs.agent.openai_agent import stop_shared_services
from areal_jobs.api import RewardResult
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
from areal_jobs.trainer.forward.hf_logprobs import token_logprobs
from areal_jobs.trainer.intake.batch import assemble
from areal_jobs.trainer.torch.backend import TorchBackend
from examples.arith_agent import ASK_AGAIN

pytestmark = pytest.mark.sglang

MAX_NEW = 24  # per turn
VERSION = 40  # the weights this file publishes first (another file may have changed the server's)
AGENT = "examples.arith_agent:agent"


class Recording:
    """The pool's SGLang client, recording every /generate with its answer."""

    def __init__(self, inner):
        self.inner, self.calls, self.name = inner, [], inner.name

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request):
        response = await self.inner.generate(request)
        self.calls.append((request, response))
        return response


class FirstRight:
    """Scores the first episode it is asked about 1, every later one 0: a group with signal."""

    def __init__(self):
        self.requests = []

    async def score_group(self, requests):
        results = [RewardResult(1.0 if not self.requests and i == 0 else 0.0) for i in range(len(requests))]
        self.requests += requests
        return results

    def metrics(self):
        return {}


@pytest.fixture(scope="module")
def run(sglang_server, tiny_model_dir):
    algo = AlgoConfig(
        batch_size=1, group_size=2, max_staleness=0, advantage=Advantage.grpo, ppo_minibatches=1
    )
    backend = TorchBackend(TrainerConfig(), algo, str(tiny_model_dir), DType.float32)
    backend.setup()
    tok = load_tokenizer(tiny_model_dir)
    data = DataConfig(num_eval_prompts=1)
    fmt = PromptFormat.load(data, tiny_model_dir)
    prompt = eval_prompts(data, tok.encode, render=fmt.render)[0]
    stream = PromptStream(data, tok.encode, render=fmt.render)
    stream.at = lambda i: dataclasses.replace(prompt, data_index=i)  # always the same prompt
    # the re-ask alone is ~80 tokens of the byte-level tokenizer: room for it and two turns
    workflow = WorkflowConfig(name="openai_agent", agent=AGENT, max_turns=2, max_episode_tokens=200)
    scorer, pushed = FirstRight(), []

    async def push(group):
        pushed.append(group)

    async def go():
        caster = Broadcaster(sglang_server)
        try:
            await caster.publish(dict(backend.iter_weights()), version=VERSION)
            client = Recording(caster.pool.slots[0].client)
            caster.pool.slots[0].client = client
            ctl = RolloutController(
                RolloutConfig(max_new_tokens=MAX_NEW, temperature=1.0, max_concurrent=2, workflow=workflow), algo,
                caster.pool, scorer, stream, tok.decode, push, stop_token_ids=tok.stop_token_ids,
                text=EpisodeText(tok.encode, tok.decode, tok.decode_raw, fmt.message_texts),
            )  # fmt: skip
            ctl.version = VERSION  # admission allows many groups; max_concurrent=2 runs one at a time
            admission = asyncio.create_task(ctl.admission_loop())
            for _ in range(3000):  # bounded wait for the first group (no timed assertion)
                if pushed or ctl.fatal is not None:
                    break
                await asyncio.sleep(0.1)
            await ctl.stop()
            admission.cancel()
            assert ctl.fatal is None, ctl.fatal
            return pushed[0], client.calls
        finally:
            await stop_shared_services()
            await caster.close()

    group, calls = asyncio.run(go())
    return {"group": group, "calls": calls, "tok": tok, "backend": backend, "algo": algo, "scorer": scorer}


def test_the_agents_episodes_are_the_servers_tokens_with_the_re_ask_masked(run):
    group, calls, tok = run["group"], run["calls"], run["tok"]
    re_ask = tok.encode(f"\n{ASK_AGAIN}\n")  # the raw rendering: the tiny model has no chat template
    assert len(group.samples) == 2
    for s in group.samples:
        turns = [resp for req, resp in calls if req.rid.split("-", 1)[1].startswith(f"{s.sample_id}")]
        assert len(turns) == 2 and s.num_turns == 2  # no weight update here: one request per turn
        first, second = turns[0].output_ids, turns[1].output_ids
        assert s.output_ids.tolist() == first + re_ask + second
        assert s.loss_mask.tolist() == [1] * len(first) + [0] * len(re_ask) + [1] * len(second)
        model = s.loss_mask.astype(bool)
        assert s.logprobs[model].tolist() == pytest.approx(turns[0].logprobs + turns[1].logprobs)
        assert np.all(s.logprobs[~model] == 0.0)
        assert s.versions.tolist() == [VERSION] * s.num_tokens
    # the workflow scored each episode's last answer (the agent returned None) with the task
    scored = {r.response for r in run["scorer"].requests}
    assert all(r.task == "arith" for r in run["scorer"].requests)
    for s in group.samples:
        last = [resp for req, resp in calls if req.rid.split("-", 1)[1].startswith(f"{s.sample_id}-t1")]
        assert tok.decode(last[0].output_ids) in scored
    assert sorted(s.reward for s in group.samples) == [0.0, 1.0]


def test_the_torch_trainer_trains_on_the_agents_episodes(run):
    group, backend = run["group"], run["backend"]
    batch = assemble([group], trainer_version=VERSION, algo=run["algo"], max_new_tokens=MAX_NEW)
    with torch.no_grad():
        backend.model.eval()
        recomputed = torch.cat(token_logprobs(backend.model, batch.samples)).numpy()
    model = np.concatenate([s.mask().astype(bool) for s in batch.samples])
    diff = np.abs(recomputed - np.concatenate([s.behav_logprobs for s in batch.samples]))[model]
    print(
        f"\nagent episodes: |server - trainer| log-prob over {diff.size} model tokens: mean {diff.mean():.2e}"
    )
    assert diff.mean() < 1e-3
    before = {n: t.clone() for n, t in backend.iter_weights()}
    metrics = backend.train_step(batch)
    assert metrics["train/num_tokens"] == sum(s.num_tokens for s in group.samples)  # masked ones too
    assert np.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    assert any(not torch.equal(before[n], t) for n, t in backend.iter_weights())
