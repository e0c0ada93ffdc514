"""Routing replay against a real vLLM server on CPU serving the tiny built-in MoE (4 experts, top-2):
every answer comes back with its request's experts, aligned with the trainer's own routing, and
replaying them in the torch trainer's forward does not widen the behaviour-vs-trainer gap.

One server for the module (never beside another of these tests). The figures of the issue come
from bench/rollout/routing_replay_bench.py (more prompts, the dense model beside).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from vllm_harness import start_vllm

from areal_jobs.config import DType
from areal_jobs.trainer.forward.routing_replay import routers
from bench.rollout.routing_replay_bench import MOE_DIR, gaps, generate, own_routes, prompts, samples_of

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    server = start_vllm(MOE_DIR, tmp_path_factory.mktemp("vllm-replay") / "server.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def answered(moe_server):
    inputs = prompts(MOE_DIR, 12)
    return inputs, asyncio.run(generate(moe_server, inputs, 32, 1.0, routes=True))


def test_every_answer_carries_its_experts_aligned_with_the_trainers(answered):
    from transformers import AutoModelForCausalLM

    inputs, responses = answered
    for p, r in zip(inputs, responses, strict=True):
        assert r.routes is not None and r.routes.ids.dtype == np.uint8
        # every input position the request computed: the prompt (no cached prefix: the prompts
        # are shorter than a KV block) and each output token but the last (never an input)
        assert r.routes.start == 0 and r.routes.ids.shape == (len(p) + len(r.output_ids) - 1, 2, 2)
        assert int(r.routes.ids.max()) < 4
    model = AutoModelForCausalLM.from_pretrained(str(MOE_DIR), dtype=torch.float32).eval()
    samples = samples_of(inputs, responses)
    sparse = [i for i, _ in routers(model)]
    agree = total = 0
    for s, own in zip(samples, own_routes(model, samples), strict=True):
        engine = np.sort(s.routes[:-1, sparse].astype(np.int64), -1)  # the last row: no route
        agree += int((engine == np.sort(own[:-1, sparse], -1)).all(-1).sum())
        total += engine.shape[0] * len(sparse)
    # the same experts almost everywhere (a near-tie may flip one): rows are where they belong
    assert agree / total > 0.98, (agree, total)


def test_replay_does_not_widen_the_gap_to_the_trainer(answered, record_property):
    inputs, responses = answered
    samples = samples_of(inputs, responses)
    off = gaps(MOE_DIR, DType.float32, samples, replay=False)
    on = gaps(MOE_DIR, DType.float32, samples, replay=True)
    for name, gap in (("off", off), ("rollout", on)):
        record_property(f"replay_{name}_max_abs", float(gap.max()))
        record_property(f"replay_{name}_mean_abs", float(gap.mean()))
        print(
            f"\nrouting_replay={name}: |server - trainer| over {gap.size} tokens: max {gap.max():.2e}, mean {gap.mean():.2e}"
        )
    assert off.size == on.size > 100
    assert on.mean() <= off.mean() + 1e-7 and on.max() <= off.max() + 1e-7
    assert on.mean() < 1e-3  # the MoE's own numeric floor on CPU (docs/moe.md), no routing noise


def test_a_client_without_replay_gets_no_routes(moe_server):
    inputs = prompts(MOE_DIR, 2)
    responses = asyncio.run(generate(moe_server, inputs, 8, 1.0, routes=False))
    assert all(r.routes is None for r in responses)
