"""The vLLM worker's route recorder (rollout/vllm_routes.py) over a stand-in model runner: one
step's rows split by request at the positions the runner laid out, decode steps appended, a
recompute after preemption, vLLM's internal request ids, and the bound on unfetched requests."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from areal_jobs.rollout import vllm_routes
from areal_jobs.transport.routes import from_engine

LAYERS, TOP_K = 2, 2


class Runner:
    """What RouteRecorder.step reads of vLLM's model runner, for one scheduled step."""

    def __init__(self):
        self.input_batch = SimpleNamespace(
            num_reqs=0, req_ids=[], num_computed_tokens_cpu=np.zeros(8, np.int32)
        )
        self.query_start_loc = SimpleNamespace(np=np.zeros(9, np.int32))

    def schedule(self, reqs: list[tuple[str, int, int]]) -> int:
        """reqs: (id, tokens computed before the step, tokens scheduled); returns the step's tokens."""
        self.input_batch.num_reqs = len(reqs)
        self.input_batch.req_ids = [r[0] for r in reqs]
        self.input_batch.num_computed_tokens_cpu[: len(reqs)] = [r[1] for r in reqs]
        self.query_start_loc.np[: len(reqs) + 1] = np.concatenate([[0], np.cumsum([r[2] for r in reqs])])
        return sum(r[2] for r in reqs)


def step(recorder, runner, reqs, value_of_token):
    """One forward: every MoE layer's router routes token t to experts value_of_token(t, layer)."""
    tokens = runner.schedule(reqs)

    def forward():
        for layer in range(LAYERS):
            ids = torch.tensor([[value_of_token(t, layer)] * TOP_K for t in range(tokens)] + [[0, 0]] * 3)
            recorder.capture(layer, ids)  # 3 rows of padding past the step's tokens: ignored
        return "hidden"

    assert recorder.step(runner, forward) == "hidden"


def taken(recorder, rid):
    got = recorder.take(rid)
    return None if got is None else from_engine(got)


def test_rows_follow_each_request_from_prefill_through_decode():
    rec, runner = vllm_routes.RouteRecorder(LAYERS, TOP_K, num_experts=4), Runner()
    # step 1: a prefills 3 tokens (nothing cached), b prefills 2 after a 4-token cached prefix
    step(
        rec,
        runner,
        [("generate-tokens-a", 0, 3), ("generate-tokens-b-0123abcd", 4, 2)],
        lambda t, layer: t % 4,
    )
    # step 2: one decode token each
    step(
        rec,
        runner,
        [("generate-tokens-a", 3, 1), ("generate-tokens-b-0123abcd", 6, 1)],
        lambda t, layer: 3 - layer,
    )
    a, b = taken(rec, "a"), taken(rec, "b")
    assert a.start == 0 and a.ids.shape == (4, LAYERS, TOP_K) and a.ids.dtype == np.uint8
    assert a.ids[:, 0, 0].tolist() == [0, 1, 2, 3] and a.ids[3, :, 0].tolist() == [3, 2]
    assert b.start == 4 and b.ids[:, 0, 0].tolist() == [3, 0, 3]  # tokens 3, 4 of step 1, then decode
    assert rec.take("a") is None  # taken once, then forgotten


def test_a_recomputed_request_overwrites_its_rows_from_there():
    rec, runner = vllm_routes.RouteRecorder(LAYERS, TOP_K, num_experts=4), Runner()
    step(rec, runner, [("r.0", 0, 5)], lambda t, layer: 1)
    step(rec, runner, [("r.0", 2, 4)], lambda t, layer: 2)  # preempted, recomputed from position 2
    r = taken(rec, "r.0")
    assert r.start == 0 and r.ids[:, 0, 0].tolist() == [1, 1, 2, 2, 2, 2]


def test_ids_match_exactly_and_unfetched_requests_are_bounded(monkeypatch):
    monkeypatch.setattr(vllm_routes, "MAX_REQUESTS", 2)
    rec, runner = vllm_routes.RouteRecorder(LAYERS, TOP_K, num_experts=300), Runner()
    for rid in ("s.1", "s.10", "s.11"):
        step(rec, runner, [(f"generate-tokens-{rid}", 0, 1)], lambda t, layer: 299)
    assert rec.take("s.1") is None  # the oldest went first, and s.1 never matches s.10 / s.11
    got = taken(rec, "s.10")
    assert got.ids.dtype == np.uint16 and got.ids[0, 0, 0] == 299
    assert taken(rec, "s.11") is not None


def test_a_warm_up_run_records_nothing():
    rec, runner = vllm_routes.RouteRecorder(LAYERS, TOP_K, num_experts=4), Runner()
    assert rec.step(runner, lambda: "out") == "out"
    assert rec.take("anything") is None
