"""areal_jobs: fully asynchronous RL for LLM reasoning, launched as one heterogeneous SLURM job.

Subpackages map to runtime roles: rollout/ (controller and servers), trainer/, reward/,
transport/ (ZeroMQ messages), weights/ (broadcast to servers), data/ (datasets, built-in task).
Nothing here imports a GPU stack at package import time.
"""
