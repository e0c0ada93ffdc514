"""Today's rollout as the simplest workflow: one answer to the prompt, scored by its reward task.

The controller runs single_turn groups on a fast path with the same effect: `answer` for every
sample, then one batched `score_group` for the whole group (rollout/controller.py).
"""

from __future__ import annotations

from areal_jobs.agent.context import EpisodeContext, Turn


async def answer(ctx: EpisodeContext) -> Turn:
    """The generation half: one model turn from the prompt, up to rollout.max_new_tokens."""
    return await ctx.generate()


async def single_turn(ctx: EpisodeContext) -> float:
    turn = await answer(ctx)
    return (await ctx.score(turn.text)).reward
