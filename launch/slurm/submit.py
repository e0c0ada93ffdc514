"""Submit one heterogeneous SLURM job per config: `make submit EXP=<experiment> OVERRIDES="..."`.

    python -m launch.submit experiment=math_qwen2_1p5b cluster.nodes=64 algo.max_staleness=8
    python -m launch.submit experiment=math_qwen2_1p5b launch.dry_run=true      # render only
    python -m launch.submit -m experiment=math_qwen2_1p5b algo.max_staleness=0,4,8   # 3 jobs

Hydra composes conf/submit.yaml (conf/config.yaml plus launcher settings); the config is planned
(launch/planning/layout/plan.py), written with the plan's values to <run dir>/config.yaml next to the rendered
<run dir>/job.sbatch (launch/slurm/render.py), and handed to `sbatch --parsable` (launch/slurm/cli.py).
SLURM refuses job arrays of heterogeneous jobs, so a multirun is Hydra's basic launcher calling
this task once per combination, each with its own run directory and its own job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig

from areal_jobs.config import (
    TOKEN_ENV,
    ClusterKind,
    JobConfig,
    check_override_keys,
    resolve_job_token,
    save_job_config,
    to_job_config,
)
from launch.planning import reward_files
from launch.planning.fit.memory_plan import MemoryPlan, check_memory, unknown_shape_note
from launch.planning.fit.reward_plan import RewardPlan, check_reward_servers
from launch.planning.layout.allocation import resolve_auto_fraction
from launch.planning.layout.plan import AllocationPlan, apply_plan
from launch.planning.layout.suggest import plan_or_explain
from launch.slurm.cli import Slurm, SlurmCli, SlurmError
from launch.slurm.preflight import check_before_writing
from launch.slurm.render import Provenance, render_sbatch, run_dir_of

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class PreparedJob:
    """Everything a submission writes: the planned config, its plan and the script text."""

    job: JobConfig
    plan: AllocationPlan
    script: str
    memory: MemoryPlan | None = None  # None: the model's shape is unknown (not checked)
    reward: RewardPlan | None = None  # the reward-model servers' check (None: the job has none)

    @property
    def run_dir(self) -> Path:
        return Path(run_dir_of(self.job))

    def memory_text(self) -> str:
        """The per-rank trainer breakdown and the servers' KV cache (launch/planning/fit/memory_plan.py)."""
        text = self.memory.describe() if self.memory is not None else unknown_shape_note(self.job)
        return text + ("\n" + self.reward.describe() if self.reward is not None else "")


def prepare(
    job: JobConfig,
    *,
    cwd: str,
    python: str,
    name_suffix: str = "",
    provenance: Provenance | None = None,
) -> PreparedJob:
    """Pure: fill the submission-time defaults, plan the layout, check that the trainer fits its
    GPUs (cluster.gpu_memory_gib; a ValueError names overrides that fit) and render the script."""
    if job.cluster.kind is not ClusterKind.slurm:
        raise ValueError(
            f"cluster.kind={job.cluster.kind.value} does not submit to SLURM: pick a SLURM cluster, e.g. "
            "cluster=h800 or cluster=local_slurm (`make run` starts the pipeline on this machine)"
        )
    cluster = dataclasses.replace(
        job.cluster, workdir=job.cluster.workdir or cwd, python=job.cluster.python or python
    )
    name = f"{job.run.name}/{name_suffix}" if name_suffix else job.run.name
    job = dataclasses.replace(
        job,
        cluster=cluster,
        run=dataclasses.replace(job.run, name=name, root=_under(cluster.workdir, job.run.root)),
        model=dataclasses.replace(job.model, builtin_dir=_under(cluster.workdir, job.model.builtin_dir)),
    )
    job = reward_files.absolute_paths(job, Path(cluster.workdir))  # the nodes import these paths
    unplanned = resolve_auto_fraction(job)
    plan = plan_or_explain(unplanned)
    job = apply_plan(unplanned, plan)
    memory = check_memory(job, plan, unplanned=unplanned)
    reward = check_reward_servers(job, plan)
    script = render_sbatch(job, plan, provenance=provenance)
    return PreparedJob(job=job, plan=plan, script=script, memory=memory, reward=reward)


def git_source(repo: Path = REPO) -> str:
    """The checkout's commit, and whether it has uncommitted changes (untracked files count: a new
    module runs too), for the script's `# Source:` line."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return f"{repo}: not a git checkout (no commit recorded)"
    if not changed:
        return f"git {sha} (clean) in {repo}"
    return f"git {sha} + uncommitted changes ({len(changed)} paths: `git -C {repo} status`) in {repo}"


def _under(workdir: str, path: str) -> str:
    """Relative paths in the config are relative to the job's working directory."""
    return path if Path(path).is_absolute() else str(Path(workdir) / path)


def ensure_builtin_model(job: JobConfig) -> None:
    """The built-in tiny model (model.path empty) is built once, here, on the shared filesystem,
    as `make run` does, so that the roles on the nodes only read it."""
    if job.model.path:
        return
    from areal_jobs.tasks.warm_start.tiny_model import TinyRecipe, build_builtin_model

    build_builtin_model(Path(job.model.builtin_dir), TinyRecipe(sft_steps=job.model.builtin_sft_steps))


def write_run_dir(prepared: PreparedJob) -> Path:
    """Write config.yaml (without run.token) and job.sbatch; create logs/ (sbatch does not create
    --output dirs). Call under the run's umask (private_files)."""
    run_dir = prepared.run_dir
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    run_dir.chmod(prepared.job.run.dir_mode)  # a directory an older version left 0755
    save_job_config(prepared.job, run_dir / "config.yaml")
    reward_files.record(prepared.job, run_dir)  # the reward function files, copied with their sha256
    script = run_dir / "job.sbatch"
    script.write_text(prepared.script)
    script.chmod(0o777 & ~prepared.job.run.umask & 0o755)
    return script


@contextlib.contextmanager
def private_files(umask: int) -> Iterator[None]:
    """The run's umask for what this process writes and for sbatch, which hands it to the job
    (SLURM_UMASK); the script sets it again itself."""
    previous = os.umask(umask)
    try:
        yield
    finally:
        os.umask(previous)


def submit(
    prepared: PreparedJob, slurm: Slurm, *, dry_run: bool, environ: Mapping[str, str] | None = None
) -> str | None:
    """Write the run directory and submit (unless dry_run). Returns the job id.

    The job token: AREAL_JOB_TOKEN in `environ` (default os.environ) wins over run.token, which
    sbatch then passes to the job in its environment (never a file); with neither, the job
    generates one at each attempt (RUN_DIR/job_token, 0600)."""
    environ = os.environ if environ is None else environ
    if (prepared.run_dir / "summary.json").exists():
        # the job script reads summary.json as "this run is over"; a new run needs its own dir
        raise ValueError(
            f"{prepared.run_dir} holds a finished run (summary.json): choose another run.name=... "
            "or move that directory away"
        )
    for warning in check_before_writing(prepared.job):  # refuses what the script itself would miss
        print(f"warning: {warning} (the roles read it on the nodes)")
    resumes = (prepared.run_dir / "checkpoints").exists()
    token, source = resolve_job_token(prepared.job.run, environ)
    with private_files(prepared.job.run.umask):
        script = write_run_dir(prepared)
    print(f"plan: {prepared.plan.describe()}")
    print(prepared.memory_text())
    for line in prepared.script.splitlines()[:20]:
        if line.startswith("# Source: "):
            print(f"source: {line.removeprefix('# Source: ')}")
    print(f"run dir: {prepared.run_dir} (mode {prepared.job.run.dir_mode:o})")
    print(f"job token: {source}")
    if dry_run:
        print(f"dry run: wrote {script} and {prepared.run_dir / 'config.yaml'}; nothing submitted")
        return None
    ensure_builtin_model(prepared.job)
    with private_files(prepared.job.run.umask):
        job_id = slurm.submit(script, env={**environ, TOKEN_ENV: token} if token else None)
        with (prepared.run_dir / "jobs.txt").open("a") as jobs:
            jobs.write(f"{job_id}\n")
    if resumes:
        print("note: the run dir has checkpoints: the job resumes from the latest one (checkpoint.resume)")
    print(f"submitted job {job_id}")
    print(f"  follow:  tail -F {prepared.run_dir}/logs/*.log")
    print(f"  status:  make status JOB={job_id}")
    print(f"  cancel:  make cancel JOB={job_id}")
    return job_id


def sweep_suffix(argv: list[str], task_overrides: list[str]) -> str:
    """Run-name suffix of one multirun job: its values of the swept keys, e.g. `max_staleness=4`."""
    parser = OverridesParser.create()
    swept = {
        o.key_or_group
        for o in parser.parse_overrides([a for a in argv if not a.startswith("-")])
        if o.is_sweep_override()
    }
    parts = [o for o in task_overrides if o.split("=", 1)[0].lstrip("+~") in swept]
    return re.sub(r"[^A-Za-z0-9_.,=+-]+", "_", ",".join(parts))


def refuse_unknown_overrides(argv: list[str], conf_dir: Path) -> None:
    """Exit 2, naming the closest real key, for an override of a key the schema lacks."""
    try:
        check_override_keys(argv, conf_dir, JobConfig)
    except ValueError as err:
        print(f"error: {err}\nnothing was submitted", file=sys.stderr)
        sys.exit(2)


def main(cfg: DictConfig) -> None:
    """`python -m launch.submit`: the door (launch/submit.py) holds Hydra's entry point."""
    hydra_cfg = HydraConfig.get()
    suffix = ""
    if hydra_cfg.mode is RunMode.MULTIRUN:
        suffix = sweep_suffix(sys.argv[1:], list(hydra_cfg.overrides.task)) or str(hydra_cfg.job.num)
    provenance = Provenance(overrides=tuple(hydra_cfg.overrides.task), source=git_source())
    try:
        job = to_job_config(cfg)
        prepared = prepare(
            job, cwd=hydra_cfg.runtime.cwd, python=sys.executable, name_suffix=suffix, provenance=provenance
        )
        submit(prepared, SlurmCli(), dry_run=job.launch.dry_run)
    except (ValueError, SlurmError) as err:
        print(f"error: {err}\nnothing was submitted for this configuration", file=sys.stderr)
        sys.exit(2)
