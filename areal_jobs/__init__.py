"""areal_jobs: fully asynchronous RL for LLM reasoning, launched as one heterogeneous SLURM job.

Subpackages map to runtime roles: rollout/ (controller and servers), trainer/, reward/,
transport/ (ZeroMQ messages), weights/ (broadcast to servers), data/ (what a user's file becomes),
tasks/ (the built-in tasks and their committed models). Nothing here imports a GPU stack at
package import time; the one import, `moved`, keeps the modules' former names working.
"""

from areal_jobs import moved as _moved

_moved.install()
