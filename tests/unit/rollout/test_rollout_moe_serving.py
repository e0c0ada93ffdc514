"""A mixture of experts is refused where its engine cannot serve it (SGLang on CPU), by name."""

import json

import pytest

from areal_jobs.config import RolloutEngine
from areal_jobs.rollout.moe_serving import check_moe_serving, check_routing_replay, expert_count


@pytest.fixture
def moe_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_local_experts": 4}))
    return tmp_path


def test_experts_are_read_from_either_name_and_dense_has_none(moe_dir, tmp_path_factory):
    assert expert_count(moe_dir) == 4
    other = tmp_path_factory.mktemp("qwen3-moe-old")
    (other / "config.json").write_text(json.dumps({"num_experts": 128}))
    assert expert_count(other) == 128
    assert expert_count("areal_jobs/tasks/models/builtin_model") == 0
    assert expert_count(tmp_path_factory.mktemp("empty")) == 0


def test_sglang_on_cpu_is_refused_naming_the_engine_override(moe_dir):
    with pytest.raises(ValueError, match="rollout/engine=vllm"):
        check_moe_serving(RolloutEngine.sglang, moe_dir, cpu=True)
    check_moe_serving(RolloutEngine.vllm, moe_dir, cpu=True)
    check_moe_serving(RolloutEngine.sglang, moe_dir, cpu=False)
    check_moe_serving(RolloutEngine.sglang, "areal_jobs/tasks/models/builtin_model", cpu=True)


def test_routing_replay_of_a_dense_model_is_refused_naming_the_knob(moe_dir):
    with pytest.raises(ValueError, match="is dense.*trainer.routing_replay=off"):
        check_routing_replay(True, "areal_jobs/tasks/models/builtin_model")
    check_routing_replay(True, moe_dir)
    check_routing_replay(False, "areal_jobs/tasks/models/builtin_model")
    with pytest.raises(ValueError, match="CPU path only.*trainer.routing_replay=off"):
        check_routing_replay(True, moe_dir, cpu=False)
