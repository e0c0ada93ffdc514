"""Workflows are chosen by name like reward functions: the registry, the config and the Hydra group
agree, and a name loads the way the controller loads it."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from areal_jobs.agent import registry
from areal_jobs.agent.multi_turn_math import multi_turn_math
from areal_jobs.agent.single_turn import single_turn
from areal_jobs.config import WorkflowConfig, register_configs, to_job_config
from areal_jobs.config.rollout import WORKFLOW_NAMES

CONF = Path(__file__).resolve().parents[3] / "conf"


def test_registry_config_and_yaml_files_list_the_same_workflows():
    assert set(registry.WORKFLOW_TARGETS) == set(WORKFLOW_NAMES)
    assert {p.stem for p in (CONF / "rollout" / "workflow").glob("*.yaml")} == set(WORKFLOW_NAMES)


def test_names_and_module_function_targets_resolve():
    assert registry.resolve("single_turn") is single_turn
    assert registry.resolve("multi_turn_math") is multi_turn_math
    assert registry.resolve("areal_jobs.agent.multi_turn_math:multi_turn_math") is multi_turn_math
    with pytest.raises(ValueError, match="rollout.workflow.name"):
        registry.target("chess")


def test_config_names_the_override_it_rejects():
    with pytest.raises(ValueError, match="rollout.workflow.name='chess'"):
        WorkflowConfig(name="chess")
    with pytest.raises(ValueError, match="rollout.workflow.max_turns"):
        WorkflowConfig(max_turns=0)
    with pytest.raises(ValueError, match="turn_discount"):
        WorkflowConfig(turn_discount=1.5)


def job(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return to_job_config(compose("config", overrides=list(overrides)))


def test_the_workflow_is_a_config_group_and_single_turn_the_default():
    assert job().rollout.workflow == WorkflowConfig()
    cfg = job("rollout/workflow=multi_turn_math", "rollout.workflow.max_turns=5").rollout.workflow
    assert (cfg.name, cfg.max_turns, cfg.turn_discount) == ("multi_turn_math", 5, 0.5)
    assert job("rollout/workflow=tool_arith").rollout.workflow.name == "tool_arith"
    assert job("rollout/workflow=openai_agent").rollout.workflow.name == "openai_agent"
