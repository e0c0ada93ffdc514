"""What the rendered script needs that can be checked on the login node, before anything is written.

The job runs from `cluster.workdir` on the shared filesystem, so what the script itself starts is
visible from here too: its working directory, `cluster.python` (every role), the rollout engine's
interpreter (`rollout/engine=vllm`: `<workdir>/.venv-vllm/bin/python` from `make vllm-venv`, or
`rollout.engine_python`) and a pyxis image given as a file. A missing one is refused with what to
run; without this the job queues, starts, and fails on the cluster (the script checks the engine
interpreter again at start).

With `cluster.container_image` the interpreters live inside the image and are not checked here.
`model.path` and the data files are the roles' inputs, not the script's: a missing one is a warning
(they may sit on a node-local or container-only path), never a refusal. A user's reward function
(reward.function, a mixture source's function) visible here is checked as `make run` checks it
(launch/planning/reward_files.py: it imports, the function exists, its signature is one of the two):
a broken one is refused; one not visible here is a warning.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from areal_jobs.config import JobConfig
from launch.slurm.render import engine_python


def _runnable(command: str) -> bool:
    if "/" in command:
        return os.path.isfile(command) and os.access(command, os.X_OK)
    return shutil.which(command) is not None


def _image_is_a_file(image: str) -> bool:
    """A path (`/shared/img.sqsh`, `./img.sqsh`), not a registry reference (`nvcr.io#nvidia/pytorch:25.01`)."""
    return image.startswith(("/", "./", "../")) and "#" not in image


def script_problems(job: JobConfig) -> list[str]:
    """What the rendered script needs and this machine says is missing, each with what to do.
    `job` is the prepared job (workdir and python filled in)."""
    c = job.cluster
    problems = []
    if not Path(c.workdir).is_dir():
        problems.append(
            f"cluster.workdir={c.workdir} is not a directory here: the job starts in it (--chdir)"
        )
    if c.container_image:
        if _image_is_a_file(c.container_image) and not Path(c.container_image).is_file():
            problems.append(f"cluster.container_image={c.container_image} does not exist")
        return problems  # the interpreters are inside the image
    if not _runnable(c.python):
        problems.append(
            f"cluster.python={c.python} is not an executable here: point it at the interpreter of the "
            "shared checkout's venv (make install in cluster.workdir)"
        )
    engine = engine_python(job)
    if engine != c.python and not _runnable(engine):
        if job.rollout.engine_python:
            fix = f"fix rollout.engine_python={job.rollout.engine_python}"
        else:
            fix = f"run `make vllm-venv` in {c.workdir}, or set rollout.engine_python=<vLLM's python>"
        problems.append(
            f"rollout.engine={job.rollout.engine.value} needs its interpreter {engine}, which does not exist: {fix}"
        )
    return problems


def input_warnings(job: JobConfig) -> list[str]:
    """Inputs of the roles missing on this machine (a warning: they may be visible on the nodes only)."""
    if job.cluster.container_image:
        return []
    warnings = []
    if job.model.path and not (Path(job.model.path) / "config.json").is_file():
        warnings.append(f"model.path={job.model.path} has no config.json here")
    paths = [(f"data.{key}", getattr(job.data, key)) for key in ("train_path", "eval_path")]
    for i, source in enumerate(job.data.sources):  # a mixture's files
        paths += [(f"data.sources.{i}.path", source.path), (f"data.sources.{i}.eval_path", source.eval_path)]
    for key, path in paths:
        if path and not Path(path).exists():  # a file, or a save_to_disk directory
            warnings.append(f"{key}={path} does not exist here")
    return warnings


def check_before_writing(job: JobConfig) -> list[str]:
    """Raise ValueError listing the script's missing needs; return the input warnings."""
    from launch.planning import reward_files  # here: the module's imports stay as they were

    problems = script_problems(job)
    if problems:
        raise ValueError("the job would fail on the cluster: " + "; ".join(problems))
    return input_warnings(job) + reward_files.check_functions(job, missing_ok=True)
