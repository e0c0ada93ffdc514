"""The one codec: round trips for every message kind, and every kind of bad input rejected."""

import json

import numpy as np
import pytest

from areal_jobs.api import BucketSpec, TensorSpec, WeightSender
from areal_jobs.transport import codec
from areal_jobs.transport import messages as m

TOKEN = "job-token"


def make_group(lengths=(3, 0, 5)) -> m.TrajectoryGroup:
    rng = np.random.default_rng(0)
    samples = tuple(
        m.SampleTrajectory(
            sample_id=f"g7/{i}",
            output_ids=rng.integers(0, 300, n).astype(np.int32),
            logprobs=-rng.random(n).astype(np.float32),
            versions=np.arange(n, dtype=np.int32) // 2 + 3,
            reward=float(i % 2),
            reward_status="ok",
            finish_reason="stop",
            num_interruptions=i,
        )
        for i, n in enumerate(lengths)
    )
    return m.TrajectoryGroup("g7r2", 7, np.array([5, 6, 7], dtype=np.int32), samples, 1.5, 0.25, attempt=2)


def test_group_round_trip_keeps_every_token_field():
    group = make_group()
    frames = codec.encode_group(group, TOKEN)
    assert len(frames) == 5
    out = codec.decode_group(frames, TOKEN)
    assert out.group_id == "g7r2" and out.data_index == 7 and out.attempt == 2
    np.testing.assert_array_equal(out.prompt_ids, group.prompt_ids)
    for a, b in zip(out.samples, group.samples, strict=True):
        assert (
            a.sample_id == b.sample_id and a.reward == b.reward and a.num_interruptions == b.num_interruptions
        )
        np.testing.assert_array_equal(a.output_ids, b.output_ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        np.testing.assert_array_equal(a.versions, b.versions)
    assert out.oldest_version == 3 and out.newest_version == 5


def test_wire_format_is_json_header_plus_little_endian_arrays():
    frames = codec.encode_group(make_group((2,)), TOKEN)
    header = json.loads(frames[0])
    assert header["schema"] == m.SCHEMA_VERSION and header["kind"] == "TrajectoryGroup"
    assert np.frombuffer(frames[1], dtype="<i4").tolist() == [5, 6, 7]
    assert b"pickle" not in frames[0] and frames[0].startswith(b"{")


@pytest.mark.parametrize(
    "msg",
    [
        m.TrainerHello(version=3, step=2),
        m.ControllerHello(version=1, num_servers=2),
        m.PauseRequest(
            version=4,
            senders=(
                WeightSender("g", "127.0.0.1", 1234, (BucketSpec(0, (TensorSpec("w", "float32", (2, 3)),)),)),
            ),
            backend="gloo",
            trained_group_ids=("g1", "g2"),
        ),
        m.GroupsExpired(group_ids=("g3",)),
        m.Paused(version=4, world_size=3, init_group=True, group_generation=2),
        m.CheckpointRequest(step=3, version=3, path="/tmp/x"),
        m.CheckpointSaved(step=3, num_groups=2, num_partial_samples=5),
        m.WeightsNeeded(reason="server 1 rejoined"),
        m.VersionPublished(version=4, update_s=0.5),
        m.VersionPublished(version=5, update_s=0.5, staleness_bound=3),
        m.DriftReport(version=5, drift=0.042, staleness_mean=2.5),
        m.UpdateFailed(version=4, stage="weight broadcast bucket 1/2", error="boom"),
        m.UpdateRetry(version=4, lost_servers=(1, 3), stage="weight broadcast bucket 1/2", error="reset"),
        m.RolloutStats(metrics={"rollout/x": 1.0}),
        m.EvalResult(version=2, accuracy=0.5, mean_reward=0.5, num_prompts=8, kind="final"),
        m.EvalResult(
            2,
            0.5,
            0.5,
            8,
            "final_greedy",
            by_bucket={"1": 0.75, "3-4": 0.25},
            bucket_sizes={"1": 4, "3-4": 4},
        ),
        m.EvalResult(
            2,
            0.25,
            0.25,
            8,
            "periodic",
            pass_at_k=0.5,
            k=4,
            samples_per_problem=4,
            mean_length_tokens=40.5,
            truncation_rate=0.125,
        ),  # fmt: skip
        m.Stop(reason="done"),
        m.Stopped(num_groups_pushed=3, metrics={"a/b": 2.0}),
    ],
)
def test_control_round_trip(msg):
    assert codec.decode_control(codec.encode_control(msg, TOKEN), TOKEN) == msg


def _envelope(**overrides):
    base = {
        "schema": m.SCHEMA_VERSION,
        "kind": "TrainerHello",
        "token": TOKEN,
        "body": {"version": 1, "step": 0},
    }
    base.update(overrides)
    return json.dumps(base).encode()


@pytest.mark.parametrize(
    "frame, fragment",
    [
        (b"\x00\xff not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (_envelope(schema=99), "schema version"),
        (_envelope(token="wrong"), "job token"),
        (_envelope(token=None), "job token"),
        (_envelope(kind="Reboot"), "unknown control message kind"),
        (_envelope(body={"version": "one", "step": 0}), "expected int"),
        (_envelope(body={"version": True, "step": 0}), "expected int"),
        (_envelope(body={"version": 1}), "missing field 'step'"),
        (_envelope(body={"version": 1, "step": 0, "evil": 1}), "unknown fields"),
    ],
)
def test_bad_control_messages_are_rejected_with_a_reason(frame, fragment):
    with pytest.raises(codec.MessageError, match=fragment):
        codec.decode_control(frame, TOKEN)


def test_bad_group_messages_are_rejected_with_a_reason():
    good = codec.encode_group(make_group(), TOKEN)
    with pytest.raises(codec.MessageError, match="5 frames"):
        codec.decode_group(good[:4], TOKEN)
    with pytest.raises(codec.MessageError, match="job token"):
        codec.decode_group(good, "other-token")
    with pytest.raises(codec.MessageError, match="output ids"):
        codec.decode_group([good[0], good[1], good[2][:-4], good[3], good[4]], TOKEN)
    nan = np.frombuffer(good[3], dtype="<f4").copy()
    nan[0] = np.nan
    with pytest.raises(codec.MessageError, match="finite"):
        codec.decode_group([good[0], good[1], good[2], nan.tobytes(), good[4]], TOKEN)
    negative = np.frombuffer(good[4], dtype="<i4").copy()
    negative[0] = -1
    with pytest.raises(codec.MessageError, match="versions"):
        codec.decode_group([*good[:4], negative.tobytes()], TOKEN)
    header = json.loads(good[0])
    header["samples"][0]["num_tokens"] = -3
    with pytest.raises(codec.MessageError, match="negative"):
        codec.decode_group([json.dumps(header).encode(), *good[1:]], TOKEN)
    header = json.loads(good[0])
    header["dtypes"]["logprobs"] = "<f8"
    with pytest.raises(codec.MessageError, match="dtypes"):
        codec.decode_group([json.dumps(header).encode(), *good[1:]], TOKEN)


def test_episodes_keep_their_loss_masks_turns_and_tool_calls_and_plain_answers_stay_5_frames():
    plain = make_group((2, 3))
    ep = m.SampleTrajectory(
        "g7/2", np.array([4, 5, 6, 7], np.int32), np.array([-1, 0, 0, -1], np.float32), np.array([3, 4, 4, 4], np.int32),
        0.5, "ok", "stop", 1, loss_mask=np.array([1, 0, 0, 1], np.uint8), num_turns=2, num_tool_calls=1,
    )  # fmt: skip
    mixed = m.TrajectoryGroup("g7", 7, plain.prompt_ids, (*plain.samples, ep))
    assert len(codec.encode_group(plain, TOKEN)) == 5
    frames = codec.encode_group(mixed, TOKEN)
    assert len(frames) == 6 and np.frombuffer(frames[5], np.uint8).tolist() == [1, 0, 0, 1]
    out = codec.decode_group(frames, TOKEN)
    assert [s.loss_mask is None for s in out.samples] == [True, True, False]
    assert out.samples[2].loss_mask.tolist() == [1, 0, 0, 1]
    assert (out.samples[2].num_turns, out.samples[2].num_tool_calls, out.samples[0].num_turns) == (2, 1, 1)
    with pytest.raises(codec.MessageError, match="loss-mask frame"):
        codec.decode_group(frames[:5], TOKEN)
    with pytest.raises(codec.MessageError, match="loss masks"):
        codec.decode_group([*frames[:5], frames[5][:-1]], TOKEN)
    with pytest.raises(codec.MessageError, match="0 or 1"):
        codec.decode_group([*frames[:5], bytes([1, 2, 0, 1])], TOKEN)
