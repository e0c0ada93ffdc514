"""When to re-plan: the planner run on what the run measures, and autoscale decisions."""
