"""Episodes: multi-turn and agentic rollouts on top of the controller's one generation path.

A workflow (`async def f(ctx: EpisodeContext) -> float`) runs one episode of one prompt: model
turns (`ctx.generate`), environment / user / tool tokens (`ctx.append`), tools (`ctx.call_tool`)
and a reward. The episode's tokens, loss mask, behaviour log-probs and per-token versions live
in an `EpisodeState` (episode.py), which checkpoints as JSON and replays on resume. Workflows are
chosen by name (`rollout/workflow=<name>`, registry.py). docs/protocols.md, "Multi-turn episodes".
"""
