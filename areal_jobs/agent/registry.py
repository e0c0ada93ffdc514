"""Workflow registry: name -> "module:function" of a Workflow (`async def f(ctx) -> float`).

Chosen by `rollout/workflow=<name>` (conf/rollout/workflow/<name>.yaml sets rollout.workflow.name).
`rollout.workflow.name` may also be a "module:function" of your own, imported the same way.
A new workflow is one line here, one yaml file, and a contract test that loads it through
`resolve`, the way the controller does.
"""

from __future__ import annotations

import functools
import importlib

WORKFLOW_TARGETS: dict[str, str] = {
    "single_turn": "areal_jobs.agent.single_turn:single_turn",
    "multi_turn_math": "areal_jobs.agent.multi_turn_math:multi_turn_math",
    "tool_arith": "areal_jobs.agent.tool_arith:tool_arith",
    "openai_agent": "areal_jobs.agent.openai_agent:openai_agent",
}


def target(name: str) -> str:
    """The "module:function" for `name` (a registry key, or itself when it has a colon)."""
    if ":" in name:
        return name
    try:
        return WORKFLOW_TARGETS[name]
    except KeyError:
        raise ValueError(
            f"unknown workflow {name!r} (rollout.workflow.name): expected one of {sorted(WORKFLOW_TARGETS)} "
            "or a 'module:function'"
        ) from None


@functools.cache
def resolve(name: str):
    """Import and return the workflow registered as `name` (cached per process)."""
    module_name, _, attr = target(name).partition(":")
    fn = getattr(importlib.import_module(module_name), attr)
    if not callable(fn):
        raise TypeError(f"workflow target {target(name)} is not callable")
    return fn
