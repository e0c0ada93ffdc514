"""EpisodeState: model turns, environment tokens and tool calls recorded token by token."""

from dataclasses import asdict

import numpy as np

from areal_jobs.agent.episode import EpisodeState
from areal_jobs.trainer.intake.batch import split_fresh
from areal_jobs.transport import messages as m


def test_turns_and_environment_tokens_keep_mask_logprobs_versions_and_events():
    s = EpisodeState("g0/0")
    assert s.open_turn() == 0
    s.add_model_tokens([5, 6], [-0.5, -0.25], version=2)
    s.close_turn("stop")
    s.add_env_tokens([9, 9, 9], version=3)
    s.add_tool_call("calculator", "1+1", "2")
    assert s.open_turn() == 5
    s.add_model_tokens([7], [-1.0], version=3)
    assert s.events[-1] == ["model", 5, 6, ""]  # the turn in progress grows with each segment
    s.close_turn("length")
    assert s.output_ids == [5, 6, 9, 9, 9, 7]
    assert s.loss_mask == [1, 1, 0, 0, 0, 1]
    assert s.logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert s.versions == [2, 2, 3, 3, 3, 3]
    assert s.events == [
        ["model", 0, 2, "stop"],
        ["env", 2, 5, ""],
        ["tool", 5, 5, {"name": "calculator", "arguments": "1+1", "result": "2"}],
        ["model", 5, 6, "length"],
    ]
    assert (s.num_turns, s.num_tool_calls, s.finish_reason, s.done) == (2, 1, "length", False)
    assert s.model_token_count == 3 and s.oldest_model_version() == 2
    assert EpisodeState(**asdict(s)) == s  # JSON-checkpointable: a copy is equal


def test_an_open_turn_is_continued_not_reopened():
    s = EpisodeState("x")
    s.open_turn()
    s.add_model_tokens([4], [-0.1], 0)
    assert s.open_turn() == 0 and s.num_turns == 1


def test_a_state_built_from_tokens_alone_is_one_turn_in_progress():
    s = EpisodeState("x", output_ids=[5], logprobs=[-0.1], versions=[0])
    assert s.events == [["model", 0, 1, ""]] and s.loss_mask == [1] and s.open_turn() == 0


def test_environment_tokens_before_any_model_token_do_not_decide_freshness():
    # a user message appended at version 1 (before the first turn), model tokens at version 4:
    # the group is as fresh as its oldest model token (4), not its oldest token (1)
    s = m.SampleTrajectory(
        "g/0", np.array([9, 9, 5, 6], np.int32), np.array([0, 0, -1, -1], np.float32),
        np.array([1, 1, 4, 5], np.int32), 1.0, "ok", "stop", 1, loss_mask=np.array([0, 0, 1, 1], np.uint8),
    )  # fmt: skip
    plain = m.SampleTrajectory(
        "g/1",
        np.array([3], np.int32),
        np.array([-1], np.float32),
        np.array([6], np.int32),
        0.0,
        "ok",
        "stop",
        0,
    )
    group = m.TrajectoryGroup("g", 0, np.array([1], np.int32), (s, plain))
    assert (group.oldest_version, group.newest_version) == (4, 6)
    # trainer at version 6, eta 2: fresh by its model tokens (6 - 4 = 2), though a token says 1
    fresh, expired = split_fresh([group], trainer_version=6, max_staleness=2)
    assert fresh == [group] and expired == []
