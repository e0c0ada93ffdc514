"""Renderer: (JobConfig, AllocationPlan) -> the text of one heterogeneous sbatch script.

Pure: the same inputs give the same bytes (the committed renders in sbatch/ are checked by a
golden test). The template, sbatch/hetjob.sbatch.tmpl, stays readable bash; it uses `{{ name }}`
placeholders so that bash's own `$VAR` needs no escaping. Python fills in only values and the
`#SBATCH` header; all runtime logic (discovery, token, trap, requeue) is in the template.
"""

from __future__ import annotations

import re
import shlex
import string
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from areal_jobs.config import ClusterConfig, JobConfig, Placement, RolloutEngine
from launch.planning.layout.plan import AllocationPlan
from launch.planning.reward_files import describe

TEMPLATE_PATH = Path(__file__).resolve().parents[2] / "sbatch" / "hetjob.sbatch.tmpl"


SECRET_KEYS = ("run.token",)  # overrides whose value is never written into the script


@dataclass(frozen=True)
class Provenance:
    """What produced a script, for whoever has to reproduce it: the command-line overrides (Hydra's
    task overrides: one multirun job's own values) and the checkout's commit. `source` is free text
    ("git <sha>", "git <sha> + uncommitted changes", "not a git checkout"); the committed
    reference renders pass a fixed one (launch/slurm/golden.py) so they do not change per commit."""

    overrides: tuple[str, ...] = ()
    source: str = "unknown"

    def command_line(self) -> str:
        """The command, with run.token's value redacted: the script is not a place for a secret."""
        shown = []
        for override in self.overrides:
            key, sep, _ = override.partition("=")
            if sep and key.lstrip("+~") in SECRET_KEYS:
                override = f"{key}=REDACTED"
            shown.append(shlex.quote(override))
        return " ".join(["python -m launch.submit", *shown])


def _one_line(text: str) -> str:
    return " ".join(text.split())


class SbatchTemplate(string.Template):
    """`{{ name }}` placeholders; anything else starting with `{{` is an error."""

    delimiter = "{{"
    pattern = r"""
    \{\{\s*(?:
      (?P<named>[a-z_][a-z0-9_]*)\s*\}\}
    | (?P<braced>(?!))
    | (?P<escaped>(?!))
    | (?P<invalid>)
    )"""


def run_dir_of(job: JobConfig) -> str:
    """Absolute run directory on the shared filesystem: run.root/run.name under cluster.workdir."""
    root = PurePosixPath(job.run.root)
    if not root.is_absolute():
        root = PurePosixPath(job.cluster.workdir) / root
    return str(root / job.run.name)


def job_name(job: JobConfig) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "-", job.run.name).strip("-") or "areal"


def survives_node_loss(plan: AllocationPlan) -> bool:
    """A het job outlives a lost rollout node where both groups have 2+ nodes and are `--no-kill`.
    SLURM 22.05 applies a node failure to the groups of a het job in turn (rollout group first)
    and requeues a group that cannot shrink (one node). Measured on the loopback cluster
    (tests/integration/slurm/test_slurm_node_loss.py, docs/faults.md): with 3 + 1 nodes and
    `--no-kill` a lost rollout node is survived, but a lost trainer node requeues the trainer group
    alone and leaves the job half finished (group 0 COMPLETED, group 1 PENDING for ever); without
    `--no-kill` any loss requeues the whole job, which resumes from its checkpoint."""
    return plan.placement is Placement.nodes and plan.rollout_nodes >= 2 and plan.trainer_nodes >= 2


def sbatch_component(
    cluster: ClusterConfig, title: str, nodes: int, tasks_per_node: int, no_kill: bool = False
) -> list[str]:
    """`#SBATCH` lines of one het component. Partition/account/qos/time are repeated per component
    (SLURM propagates some of them, not all) so the header reads the same for every group."""
    lines = [f"# component: {title}"]
    for option, value in (
        ("partition", cluster.partition),
        ("account", cluster.account),
        ("qos", cluster.qos),
        ("time", cluster.time_limit),
    ):
        if value:
            lines.append(f"#SBATCH --{option}={value}")
    resources = (
        f"#SBATCH --nodes={nodes} --ntasks-per-node={tasks_per_node} "
        f"--cpus-per-task={cluster.cpus_per_task} --gres=gpu:{cluster.gpus_per_node} --exclusive"
    )
    if cluster.mem_per_node:
        resources += f" --mem={cluster.mem_per_node}"
    lines.append(resources)
    if no_kill:  # a failed node leaves the job instead of requeueing it
        lines.append("#SBATCH --no-kill")
    lines += [f"#SBATCH {arg}" for arg in cluster.sbatch_args]
    return lines


def sbatch_header(job: JobConfig, plan: AllocationPlan) -> str:
    """Job-wide options, then group 0 (rollout) and group 1 (trainer + controller)."""
    cluster = job.cluster
    run_dir = run_dir_of(job)
    lines = [
        f"#SBATCH --job-name={job_name(job)}",
        f"#SBATCH --output={run_dir}/logs/sbatch-%j.out",
        "#SBATCH --open-mode=append",
        f"#SBATCH --chdir={cluster.workdir}",
        "#SBATCH --requeue",
    ]
    if cluster.requeue_signal_s:
        lines.append(f"#SBATCH --signal=B:USR1@{cluster.requeue_signal_s}")
    if plan.placement is not Placement.nodes:  # one job over whole nodes, split per step
        title = f"rollout servers + trainer + rollout controller ({plan.placement.value} placement)"
        return "\n".join(lines + sbatch_component(cluster, title, plan.nodes, cluster.gpus_per_node))
    no_kill = survives_node_loss(plan)
    lines += sbatch_component(
        cluster, "0 = rollout servers", plan.rollout_nodes, plan.servers_per_node, no_kill
    )
    lines.append("#SBATCH hetjob")
    lines += sbatch_component(
        cluster, "1 = trainer + rollout controller", plan.trainer_nodes, plan.trainer_tasks_per_node, no_kill
    )
    if plan.reward_nodes:
        lines.append("#SBATCH hetjob")
        lines += sbatch_component(
            cluster, "2 = reward-model servers", plan.reward_nodes, plan.reward_servers_per_node
        )
    return "\n".join(lines)


def _reward_values(job: JobConfig, plan: AllocationPlan) -> dict[str, str]:
    """The reward-model servers (het group 2), or nothing: the template's three `reward_*`
    placeholders end existing lines, so a job without a reward model renders as before."""
    if not plan.reward_nodes:
        return {"reward_servers": "", "reward_stop": "", "reward_check": ""}
    tp = plan.reward_tp
    last = plan.reward_base_port + plan.num_reward_servers - 1
    block = f"""

# ------------------------------------------------------------------ reward-model servers (het group 2)
# reward.source={job.reward.source.value}: task i is reward-model server i ({job.reward.model.kind.value}, {job.reward.model.engine.value})
# on GPUs [local_id * {tp}, (local_id + 1) * {tp}) of its node, port {plan.reward_base_port} + i (up to {last}),
# supervised like a rollout server (restarted in place, areal_jobs/rollout/supervise.py --reward).
# They register in $RUN_DIR/reward_servers/, where the controller's reward scorer finds them
# (again after a restart); a reward whose server is gone past reward.model.deadline_s fails
# (model_error: counted, never trained as 0).
REWARD_NODELIST=$SLURM_JOB_NODELIST_HET_GROUP_2
mkdir -p "$RUN_DIR/reward_servers" && rm -f "$RUN_DIR"/reward_servers/*.json
log "reward-model servers on $REWARD_NODELIST"
srun --het-group=2 --ntasks-per-node={plan.reward_servers_per_node} --job-name=areal-reward-servers \\
    --kill-on-bad-exit=0 --no-kill{srun_container(job.cluster)} \\
    --output="$LOG_DIR/reward-server-%t.log" \\
    bash -c 'first=$((SLURM_LOCALID * {tp}))
             export CUDA_VISIBLE_DEVICES=$(seq -s, "$first" $((first + {tp} - 1)))
             export AREAL_BIND_HOST=${{AREAL_BIND_HOST:-$(hostname)}}
             exec "$PYTHON" -m areal_jobs.rollout.supervise --config "$CONFIG" --index "$SLURM_PROCID" --reward' &
REWARD_SERVERS_PID=$!"""
    stop = """
    steps=$(squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j" | awk '$2 == "areal-reward-servers" {print $1}')
    [ -z "$steps" ] || scancel --signal=TERM $steps || true
    stop_step "$REWARD_SERVERS_PID" "reward-model servers" 60 || true"""
    check = '\n        kill -0 "$REWARD_SERVERS_PID" 2>/dev/null || failed="reward-model servers"'
    return {"reward_servers": block, "reward_stop": stop, "reward_check": check}


def _placement_values(plan: AllocationPlan) -> dict[str, str]:
    """The lines that differ between a heterogeneous job and a GPU-level split."""
    if plan.placement is Placement.nodes:
        return {
            "role_nodes": "ROLLOUT_NODELIST=$SLURM_JOB_NODELIST_HET_GROUP_0\n"
            "TRAINER_NODELIST=$SLURM_JOB_NODELIST_HET_GROUP_1",
            "rollout_srun": 'srun --het-group=0 --ntasks-per-node="$SERVERS_PER_NODE"',
            "trainer_group": "--het-group=1 ",
            "trainer_srun": 'srun --het-group=1 --ntasks-per-node="$TRAINER_TASKS_PER_NODE"',
        }
    serving_nodes = plan.rollout_nodes + (1 if plan.shared_servers else 0)
    hostnames = 'scontrol show hostnames "$SLURM_JOB_NODELIST"'
    role_nodes = "\n".join(
        [
            f"# {plan.placement.value} placement: the servers use {plan.rollout_where()};",
            f"# the trainer uses {plan.trainer_where()}",
            f"ROLLOUT_NODELIST=$({hostnames} | head -n {serving_nodes} | paste -sd,)",
            f"TRAINER_NODELIST=$({hostnames} | tail -n {plan.trainer_nodes} | paste -sd,)",
            "# task i of a step runs on line i of its hostfile (srun --distribution=arbitrary)",
            f"{hostnames} \\",
            f'    | awk -v whole={plan.rollout_nodes} -v full="$SERVERS_PER_NODE" -v shared={plan.shared_servers} \\',
            "        '{ n = (NR <= whole) ? full : (NR == whole + 1) ? shared : 0; "
            'for (i = 0; i < n; i++) print }\' > "$RUN_DIR/rollout.hosts"',
            f"{hostnames} | tail -n {plan.trainer_nodes} \\",
            f'    | awk -v first={plan.trainer_tasks_first_node} -v full="$TRAINER_TASKS_PER_NODE" \\',
            "        '{ n = (NR == 1) ? first : full; for (i = 0; i < n; i++) print }' > \"$RUN_DIR/trainer.hosts\"",
        ]
    )
    return {
        "role_nodes": role_nodes,
        # every step sees the node's GPUs (--overlap) and pins its own with CUDA_VISIBLE_DEVICES
        "rollout_srun": (
            f'SLURM_HOSTFILE="$RUN_DIR/rollout.hosts" srun --distribution=arbitrary '
            f"--ntasks={plan.num_servers} --overlap"
        ),
        "trainer_group": "",
        "trainer_srun": (
            f'SLURM_HOSTFILE="$RUN_DIR/trainer.hosts" srun --distribution=arbitrary '
            f"--ntasks={plan.trainer_world_size} --overlap"
        ),
    }


def srun_container(cluster: ClusterConfig) -> str:
    if not cluster.container_image:
        return ""
    args = [f"--container-image={cluster.container_image}", f"--container-workdir={cluster.workdir}"]
    if cluster.container_mounts:
        args.append(f"--container-mounts={cluster.container_mounts}")
    return " \\\n    " + " ".join(shlex.quote(arg) for arg in args)


def nccl_exports(cluster: ClusterConfig) -> str:
    if not cluster.nccl_env:
        return "# (none set)"
    return "\n".join(
        f"export {key}={shlex.quote(str(cluster.nccl_env[key]))}" for key in sorted(cluster.nccl_env)
    )


def _check_paths(cluster: ClusterConfig) -> None:
    if not PurePosixPath(cluster.workdir).is_absolute():
        raise ValueError(
            f"cluster.workdir={cluster.workdir!r} must be an absolute path on the shared filesystem "
            "(launch.submit fills in the current directory when it is empty)"
        )
    if not cluster.python:
        raise ValueError(
            "cluster.python is empty: set the interpreter the nodes run, e.g. cluster.python=python"
        )


def inputs_lines(job: JobConfig) -> str:
    """Header lines naming the roles' input files as the nodes read them (paths, never copies
    of data), and each user reward function with its file's sha256; "" when there are none."""
    data = [
        f"data.{key}={getattr(job.data, key)}"
        for key in ("train_path", "eval_path")
        if getattr(job.data, key)
    ]
    for i, source in enumerate(getattr(job.data, "sources", None) or ()):  # a mixture's files
        data += [
            f"data.sources.{i}.{k}={getattr(source, k)}"
            for k in ("path", "eval_path")
            if getattr(source, k, "")
        ]
    lines = [f"# Inputs: {_one_line(' '.join(data))}"] if data else []
    lines += [f"# Reward function: {_one_line(line)}" for line in describe(job)]
    return "".join("\n" + line for line in lines)


def engine_python(job: JobConfig) -> str:
    """The rollout servers' engine interpreter on the nodes: rollout.engine_python, else the
    checkout's .venv-vllm for vLLM (made by `make vllm-venv` in cluster.workdir), else cluster.python."""
    if job.rollout.engine_python:
        return job.rollout.engine_python
    if job.rollout.engine is RolloutEngine.vllm:
        return str(PurePosixPath(job.cluster.workdir) / ".venv-vllm" / "bin" / "python")
    return job.cluster.python


def render_sbatch(
    job: JobConfig, plan: AllocationPlan, template: str | None = None, provenance: Provenance | None = None
) -> str:
    """The sbatch script for `job` laid out by `plan` (pass the planned job: see plan.apply_plan),
    headed by what produced it (`provenance`)."""
    provenance = provenance or Provenance()
    _check_paths(job.cluster)
    text = template if template is not None else TEMPLATE_PATH.read_text()
    last_port = plan.server_base_port + plan.num_servers - 1
    values = {
        "plan_summary": plan.describe(),
        "umask": f"{job.run.umask:03o}",
        "run_dir_mode": f"{job.run.dir_mode:o}",
        "file_modes": "group-readable (0750 / 0640)" if job.run.share_with_group else "private (0700 / 0600)",
        "command": _one_line(provenance.command_line()),
        "source": _one_line(provenance.source),
        "inputs": inputs_lines(job),
        "sbatch_header": sbatch_header(job, plan),
        "run_dir": shlex.quote(run_dir_of(job)),
        "python": shlex.quote(job.cluster.python),
        "rollout_engine": job.rollout.engine.value,
        "engine_python": shlex.quote(engine_python(job)),
        "rollout_tp": str(plan.rollout_tp),
        "servers_per_node": str(plan.servers_per_node),
        "trainer_tasks_per_node": str(plan.trainer_tasks_per_node),
        "loopback": "1" if job.cluster.loopback else "0",
        "master_port": str(plan.trainer_master_port),
        "controller_port": str(plan.controller_port),
        "weight_sync_port": str(plan.weight_sync_port),
        "server_ports": f"{plan.server_base_port}-{last_port}",
        "requeue_signal_s": str(job.cluster.requeue_signal_s),
        "node_check_s": str(job.cluster.node_check_s),
        "nccl_exports": nccl_exports(job.cluster),
        "srun_container": srun_container(job.cluster),
        "placement": plan.placement.value,
        "trainer_gpus": plan.trainer_gpu_ids or '""',
        # the re-planner counts whole rollout nodes (launch/run/replanner.py: slurm_shape)
        "node_loss": "1" if survives_node_loss(plan) else "0",
        "replan": "1" if job.cluster.replan_every_steps and plan.placement is Placement.nodes else "0",
        **_placement_values(plan),
        **_reward_values(job, plan),
    }
    tmpl = SbatchTemplate(text)
    unused = set(values) - set(tmpl.get_identifiers())
    if unused:
        raise ValueError(f"template {TEMPLATE_PATH.name} lacks placeholders {sorted(unused)}")
    return tmpl.substitute(values)
