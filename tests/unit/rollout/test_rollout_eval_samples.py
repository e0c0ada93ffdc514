"""An evaluation dumps one record per prompt (stop reason, version span) and sends the model's end
tokens and stop strings with every request."""

import asyncio

from areal_jobs.data.prompts import Prompt
from areal_jobs.rollout.evaluation import evaluate
from areal_jobs.rollout.generation import GenerationPath, Sampling
from areal_jobs.rollout.server_pool import ServerPool

from .fake_server import FakeServer, ZeroScorer


def test_eval_records_stop_reason_and_sends_stop_conditions():
    # prompt 0 (3 tokens) ends with EOS at position 6; prompt 1 (2 tokens) hits max_new_tokens=4 first
    server = FakeServer("a", token_s=0.0, answer_len=lambda ids: 6 if len(ids) == 3 else 99)
    server.weight_version = 5
    pool = ServerPool()
    pool.add(0, server)
    records = []
    prompts = [Prompt(-1, [1, 2, 3], "math", "7"), Prompt(-2, [4, 5], "math", "8")]
    running = asyncio.Event()
    running.set()
    summary = asyncio.run(
        evaluate(
            GenerationPath(pool, running, lambda: 5), ZeroScorer(), prompts,
            lambda ids: " ".join(map(str, ids)), tag="final", dump=records.extend,
            sampling=Sampling(4, 0.0, stop_token_ids=(0, 2), stop=("</s>",)),
        )
    )  # fmt: skip
    assert summary.num_prompts == 2
    assert [(r.kind, r.prompt, r.response, r.stop_reason) for r in records] == [
        ("final", "1 2 3", "103 104 0", "stop"),
        ("final", "4 5", "102 103 104 105", "length"),
    ]
    assert {(r.version_min, r.version_max, r.step) for r in records} == {(5, 5, 5)}
    assert {(q.stop_token_ids, q.stop) for q in server.requests} == {((0, 2), ("</s>",))}
