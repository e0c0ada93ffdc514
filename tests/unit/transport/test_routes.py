"""Expert routes from the engine to the trainer (transport/routes.py, routing replay): the worker's
answer, the episode's JSON segments across an interruption, the sample's array, the wire codec and
the packed row."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

from areal_jobs.api import ExpertRoutes, FinishReason, GenerateResponse
from areal_jobs.rollout.generation import Sampling
from areal_jobs.rollout.snapshot import PartialSample, to_trajectory
from areal_jobs.transport import codec, routes
from areal_jobs.transport import messages as m
from tests.unit.rollout.test_rollout_generation_path import Scripted, path_over

L, K = 2, 2  # layers, top_k


def rows(start_value: int, n: int) -> np.ndarray:
    """n distinct rows [n, L, K] (values start_value + position-ish), uint8."""
    base = (np.arange(n, dtype=np.uint8)[:, None, None] + start_value) % 4
    return np.broadcast_to(base, (n, L, K)).astype(np.uint8).copy()


def worker_answer(start: int, ids: np.ndarray) -> dict:
    return {
        "start": start,
        "shape": list(ids.shape),
        "dtype": ids.dtype.name,
        "data": base64.b64encode(ids.tobytes()).decode(),
    }


def test_dtype_keeps_the_fill_value_free():
    assert routes.route_dtype(4) == np.uint8 and routes.route_dtype(254) == np.uint8
    assert routes.route_dtype(255) == np.uint16 and routes.route_dtype(128 * 4) == np.uint16
    assert routes.no_route("uint8") == 255 and routes.no_route("uint16") == 65535
    with pytest.raises(ValueError, match="65,534"):
        routes.route_dtype(70000)


def test_a_worker_answer_decodes_and_survives_the_episode_json():
    ids = rows(1, 5)
    got = routes.from_engine(worker_answer(3, ids))
    assert got.start == 3 and got.ids.dtype == np.uint8 and np.array_equal(got.ids, ids)
    entry = json.loads(json.dumps(routes.to_json(got)))  # checkpoints keep it as plain JSON
    back = routes.from_json(entry)
    assert back.start == 3 and np.array_equal(back.ids, ids)
    wide = np.array([[[300, 2]]], dtype=np.uint16)
    assert np.array_equal(routes.from_engine(worker_answer(0, wide)).ids, wide)
    with pytest.raises(ValueError, match="dtype"):
        routes.from_engine({**worker_answer(0, ids), "dtype": "int64"})


def test_a_continued_generation_keeps_each_positions_routes_as_first_reported():
    segments: list = []
    routes.add_segment(segments, ExpertRoutes(2, rows(0, 6)))  # prompt 0..1 cached: positions 2..7
    # continued under new weights: the new call reports 0..9; only 8..9 are new
    routes.add_segment(segments, ExpertRoutes(0, rows(3, 10)))
    out = routes.assemble(segments, 11)
    assert out.shape == (11, L, K)
    assert (out[:2] == 255).all()  # the cached prefix stays unreported (not filled by later weights)
    assert np.array_equal(out[2:8], rows(0, 6))
    assert np.array_equal(out[8:10], rows(3, 10)[8:10])
    assert (out[10] == 255).all()  # the last token was never an input
    routes.add_segment(segments, ExpertRoutes(0, rows(1, 4)))  # nothing new: nothing added
    assert len(segments) == 2
    assert routes.assemble([], 5) is None


def test_pack_lays_routes_out_as_the_packed_row():
    a, b = rows(0, 3), rows(1, 4)
    packed = routes.pack([a, None, b], [3, 2, 5])
    assert packed.shape == (10, L, K)
    assert np.array_equal(packed[:3], a) and (packed[3:5] == 255).all()
    assert np.array_equal(packed[5:9], b) and (packed[9] == 255).all()
    assert routes.pack([None, None], [3, 4]) is None
    with pytest.raises(ValueError, match="disagree"):
        routes.pack([a, rows(0, 2).astype(np.uint16)], [3, 2])


def test_the_generation_path_carries_routes_through_an_interruption():
    """Segment 1 (weights 0) routes input positions 0..3 (prompt 2 + 2 tokens, the last one not
    yet); the continuation (weights 1) re-prefills and reports 0..4: only 3..4 are taken from it."""
    first, second = rows(0, 3), rows(2, 5)
    server = Scripted(
        "a",
        [
            GenerateResponse([5, 6], [-0.5, -0.25], FinishReason.abort, 0, ExpertRoutes(0, first)),
            GenerateResponse([7, 0], [-1.0, -2.0], FinishReason.stop, 1, ExpertRoutes(0, second)),
        ],
    )
    state = PartialSample("s")
    asyncio.run(path_over(server).run("s", [1, 2], state, Sampling(10, temperature=1.0)))
    sample = to_trajectory(state, num_prompt_tokens=2)
    assert sample.routes.shape == (6, L, K)
    assert np.array_equal(sample.routes[:3], first) and np.array_equal(sample.routes[3:5], second[3:5])
    assert (sample.routes[5] == 255).all()
    assert to_trajectory(PartialSample("t", output_ids=[3]), 2).routes is None  # replay off: no cost


def group(with_routes: bool) -> m.TrajectoryGroup:
    def sample(i, n, r):
        return m.SampleTrajectory(
            f"g/{i}", np.arange(n, dtype=np.int32), np.full(n, -0.5, np.float32), np.zeros(n, np.int32),
            1.0, "ok", "stop", 0, routes=r,
        )  # fmt: skip

    r0 = rows(0, 3 + 4) if with_routes else None
    return m.TrajectoryGroup("g", 0, np.array([1, 2, 3], np.int32), (sample(0, 4, r0), sample(1, 2, None)))


def test_the_wire_codec_carries_routes_and_refuses_a_missing_frame():
    assert m.SCHEMA_VERSION == 4
    frames = codec.encode_group(group(True), "tok")
    assert len(frames) == 6 and len(frames[-1]) == 7 * L * K  # uint8 on the wire: one byte an expert
    back = codec.decode_group(frames, "tok")
    assert np.array_equal(back.samples[0].routes, group(True).samples[0].routes)
    assert back.samples[0].routes.dtype == np.uint8 and back.samples[1].routes is None
    plain = codec.encode_group(group(False), "tok")
    assert len(plain) == 5 and codec.decode_group(plain, "tok").samples[0].routes is None
    with pytest.raises(codec.MessageError, match="route frame"):
        codec.decode_group(frames[:-1], "tok")
    with pytest.raises(codec.MessageError, match="expert routes"):
        codec.decode_group(frames[:-1] + [frames[-1][:-1]], "tok")


def test_scored_coverage_counts_outputs_predicted_through_replayed_positions():
    r = rows(0, 7)  # prompt 3 + output 4
    r[6] = 255  # the last token: never an input
    assert routes.scored_coverage(r, 3) == (4, 4)  # outputs are predicted at positions 2..5
    r[2] = 255  # a cached prompt position: the first output token is predicted without routes
    assert routes.scored_coverage(r, 3) == (3, 4)
    assert routes.scored_coverage(None, 3) == (0, 0)
