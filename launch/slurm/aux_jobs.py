"""Homogeneous auxiliary SLURM jobs through submitit: evaluate a checkpoint, convert checkpoints
HF <-> Megatron, or any command, on the same partition/account/container as a run.

    python -m launch.slurm.aux_jobs --run-dir runs/math_qwen2_1p5b --gpus 8 --wait -- python -m MODULE ARGS

Why the RL job itself is not submitted with submitit: it is a *heterogeneous* job (rollout and
trainer groups with different shapes), and submitit cannot express one. Its sbatch writer emits a
single block of `#SBATCH` options with no `hetjob` separator; its srun runs the pickled function
on one component only; its `map_array` (and Hydra's submitit launcher) always submits a job array,
and SLURM refuses arrays of heterogeneous jobs. So launch/slurm/render.py writes that script, and
submitit is used here, for one-component jobs, where its pickled results and state tracking help.

State tracking goes through `sacct`: on clusters without accounting submitit cannot see a job
that died without writing its result (it reports UNKNOWN); see docs/slurm.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from areal_jobs.config import ClusterConfig, load_job_config

FINAL_STATES = (
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
)  # fmt: skip


def executor_parameters(
    cluster: ClusterConfig, *, name: str, nodes: int, gpus_per_node: int, timeout_min: int
) -> dict[str, object]:
    """submitit parameters for a one-component job shaped like `cluster` (pure; tested)."""
    params: dict[str, object] = {
        "name": name,
        "nodes": nodes,
        "tasks_per_node": 1,
        "cpus_per_task": cluster.cpus_per_task,
        "gpus_per_node": gpus_per_node,
        "timeout_min": timeout_min,
    }
    for key, value in (
        ("slurm_partition", cluster.partition),
        ("slurm_account", cluster.account),
        ("slurm_qos", cluster.qos),
        ("slurm_mem", cluster.mem_per_node),
    ):
        if value:
            params[key] = value
    extra = {}
    for arg in cluster.sbatch_args:  # "--constraint=h800" -> {"constraint": "h800"}
        key, _, value = arg.lstrip("-").partition("=")
        extra[key] = value or True
    if extra:
        params["slurm_additional_parameters"] = extra
    if cluster.container_image:
        srun_args = [f"--container-image={cluster.container_image}"]
        if cluster.container_mounts:
            srun_args.append(f"--container-mounts={cluster.container_mounts}")
        params["slurm_srun_args"] = srun_args
    return params


def submit_command(
    cluster: ClusterConfig,
    folder: Path,
    command: list[str],
    *,
    name: str,
    nodes: int = 1,
    gpus_per_node: int = 0,
    timeout_min: int = 60,
):
    """Submit `command` as a one-component job; returns the submitit Job (result = its stdout)."""
    import submitit  # optional dependency (extra `slurm`): imported only where used

    executor = submitit.AutoExecutor(folder=folder / "%j", cluster="slurm")
    executor.update_parameters(
        **executor_parameters(
            cluster, name=name, nodes=nodes, gpus_per_node=gpus_per_node, timeout_min=timeout_min
        )
    )
    workdir = cluster.workdir or None
    return executor.submit(submitit.helpers.CommandFunction(command, cwd=workdir))


def watch(
    job,
    *,
    poll_s: float = 5.0,
    report: Callable[[str], None] = print,
    timeout_s: float | None = None,
    settle_s: float = 60.0,
) -> str:
    """Report every state change of a submitit job until it ends; return the final state.

    submitit writes the result file before the job step exits, so a job may be done while
    SLURM still says RUNNING (COMPLETING): the final state is then awaited for up to `settle_s`.
    Raises TimeoutError after `timeout_s` (None = as long as the job runs).
    """
    last = ""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    done_at: float | None = None
    while True:
        state = job.watcher.get_state(job.job_id, mode="force")
        if state != last:
            report(f"job {job.job_id}: {state}")
            last = state
        if state.split(" ")[0] in FINAL_STATES:
            return state
        now = time.monotonic()
        if done_at is None and job.done(force_check=True):
            done_at = now
        if done_at is not None and now - done_at > settle_s:
            return f"{state} (result written {settle_s:.0f} s ago; SLURM has not reported a final state)"
        if deadline is not None and now > deadline:
            raise TimeoutError(f"job {job.job_id} still {state} after {timeout_s:.0f} s")
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launch.slurm.aux_jobs",
        description="Submit a one-component helper job (checkpoint evaluation or conversion, any command) "
        "with the partition/account/container of a run.",
    )
    parser.add_argument(
        "--run-dir", required=True, help="run directory holding config.yaml (from make submit)"
    )
    parser.add_argument("--name", default="areal-aux", help="SLURM job name")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--timeout-min", type=int, default=60)
    parser.add_argument(
        "--wait", action="store_true", help="watch the job until it ends and print its output"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --, e.g. -- python -m MODULE --config RUN_DIR/config.yaml")
    run_dir = Path(args.run_dir).resolve()
    cluster = load_job_config(run_dir / "config.yaml").cluster
    job = submit_command(
        cluster,
        run_dir / "aux",
        command,
        name=args.name,
        nodes=args.nodes,
        gpus_per_node=args.gpus,
        timeout_min=args.timeout_min,
    )
    print(f"submitted job {job.job_id}; logs in {run_dir / 'aux' / job.job_id}")
    if not args.wait:
        return 0
    state = watch(job)
    if state.startswith("COMPLETED"):
        print(job.result(), end="")
        return 0
    print(job.stderr() or "", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
