"""`tool_arith`: the built-in arithmetic task with a calculator the model may call mid-answer.

The call format is tasks/arith_tools.py's: the model writes "a: 8+3=<calc>(8+3)%10</calc>", its
turn stops at "</calc>", the calculator's result ("1") is appended with loss mask 0, and the
model continues from it. Up to `rollout.workflow.max_tool_calls` calls an episode; after the last
one the model's turns no longer stop at "</calc>", so a further call is plain text that nobody
answers. The episode's reward is the task's reward on the whole answer (tool results included:
the final "The answer is N." sentence is the model's own).

Why tools pay off here: the warm start (areal_jobs/tasks/models/builtin_model_tools) writes one digit too
high on the misconception facts (arith_task.MISCONCEPTION_FACTS) and slips elsewhere, while a
called step is always right. The warm start calls rarely, so RL has a behaviour to amplify that
raises the reward: the run shows accuracy and rollout/tool_calls_per_episode rising together.

Deterministic given what the context returns (agent/context.py: replay on resume).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_jobs.tasks.arith_tools import CALL_CLOSE, TOOL_NAME, expression_of

if TYPE_CHECKING:
    from areal_jobs.agent.context import EpisodeContext


async def tool_arith(ctx: EpisodeContext) -> float:
    """Generate, answering each calculator call, until the model ends its answer; its reward."""
    while True:
        may_call = ctx.num_tool_calls < ctx.config.max_tool_calls
        turn = await ctx.generate(stop=(CALL_CLOSE,) if may_call else None)
        if not (may_call and turn.finish_reason == "stop" and turn.text.rstrip().endswith(CALL_CLOSE)):
            break  # the answer ended (end of sequence), or ran out of tokens
        result = await ctx.call_tool(TOOL_NAME, expression_of(turn.text))
        ctx.append(ctx.encode(result))
    answer = ctx.decode(ctx.token_ids[len(ctx.prompt.input_ids) :])
    return (await ctx.score(answer)).reward
