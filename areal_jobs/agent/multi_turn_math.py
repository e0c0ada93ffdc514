"""Multi-turn math with feedback (AReaL's multi-turn example): answer; if wrong, the user says so.

    turn 0: model answers ── right ─▶ reward 1
                  │ wrong
                  ▼
    user: "Your answer is incorrect. Try again."  (rendered with the tokenizer's chat template)
    turn 1: model answers ── right ─▶ reward turn_discount**1
    ...     up to rollout.workflow.max_turns model turns; never right: reward 0

Each answer is scored alone (the prompt's reward task and reference), not the whole transcript.
"""

from __future__ import annotations

from areal_jobs.agent.context import EpisodeContext

FEEDBACK = "Your answer is incorrect. Try again."


async def multi_turn_math(ctx: EpisodeContext) -> float:
    for t in range(ctx.config.max_turns):
        turn = await ctx.generate()
        if (await ctx.score(turn.text)).reward > 0:
            return ctx.config.turn_discount**t
        if t + 1 < ctx.config.max_turns:
            ctx.append(ctx.render_message("user", FEEDBACK))
    return 0.0
