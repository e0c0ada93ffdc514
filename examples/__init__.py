"""Worked examples: agents written only against the `openai` client, trained with
rollout/workflow=openai_agent rollout.workflow.agent=examples.<module>:<function> (docs/agents.md)."""
