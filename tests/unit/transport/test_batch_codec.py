"""TrainBatch bytes for the Megatron ranks: exact round trip, and malformed bytes refused."""

from dataclasses import replace

import numpy as np
import pytest

from areal_jobs.api import TrainBatch, TrainSample
from areal_jobs.transport.batch_codec import decode_train_batch, encode_train_batch
from areal_jobs.transport.codec import MessageError


def batch() -> TrainBatch:
    rng = np.random.default_rng(0)
    samples = [
        TrainSample(
            f"g{i}/0",
            rng.integers(0, 1 << 40, size=5 + i),
            2,
            rng.standard_normal(3 + i).astype(np.float32),
            np.arange(3 + i, dtype=np.int32),
            0.25 * i - 0.5,
            float(i),
            None if i % 2 else (np.arange(3 + i) % 2).astype(np.uint8),
        )
        for i in range(3)
    ]
    return TrainBatch(7, samples, ["g0", "g1"], ["g9"], max_new_tokens=32)


def test_round_trip_is_exact():
    original = batch()
    got = decode_train_batch(encode_train_batch(original))
    assert (got.version, got.group_ids, got.filtered_group_ids, got.max_new_tokens) == (
        7,
        ["g0", "g1"],
        ["g9"],
        32,
    )
    for a, b in zip(original.samples, got.samples, strict=True):
        assert (a.sample_id, a.num_prompt_tokens, a.advantage, a.reward) == (
            b.sample_id,
            b.num_prompt_tokens,
            b.advantage,
            b.reward,
        )
        for x, y in (
            (a.input_ids, b.input_ids),
            (a.behav_logprobs, b.behav_logprobs),
            (a.versions, b.versions),
        ):
            assert x.dtype == y.dtype and np.array_equal(x, y)
        assert (a.loss_mask is None) == (b.loss_mask is None)
        assert np.array_equal(a.mask(), b.mask())


def test_truncated_or_padded_bytes_are_refused():
    data = encode_train_batch(batch())
    with pytest.raises(MessageError):
        decode_train_batch(data[:-1])
    with pytest.raises(MessageError, match="trailing"):
        decode_train_batch(data + b"\0")
    with pytest.raises(MessageError):
        decode_train_batch(b"\1\0")


def test_expert_routes_travel_with_their_samples():
    """trainer.routing_replay=rollout: the routes reach every Megatron rank, sample by sample,
    a sample without routes stays without."""
    original = batch()
    rng = np.random.default_rng(1)
    routes = [rng.integers(0, 255, size=(len(s.input_ids), 3, 2), dtype=np.uint8) for s in original.samples]
    routes[1] = None
    routes[2][-1] = 255  # the last token's row: not reported
    original.samples = [replace(s, routes=r) for s, r in zip(original.samples, routes, strict=True)]
    data = encode_train_batch(original)
    got = decode_train_batch(data)
    for r, s in zip(routes, got.samples, strict=True):
        assert (r is None and s.routes is None) or (s.routes.dtype == r.dtype and np.array_equal(s.routes, r))
    with pytest.raises(MessageError):
        decode_train_batch(data[:-1])
    wide = replace(original.samples[0], routes=routes[0].astype(np.uint16))
    assert (
        decode_train_batch(encode_train_batch(TrainBatch(7, [wide], []))).samples[0].routes.dtype == np.uint16
    )
    with pytest.raises(ValueError, match="disagree"):
        encode_train_batch(TrainBatch(7, [wide, original.samples[0]], []))
