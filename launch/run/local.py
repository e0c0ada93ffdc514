"""Run the whole job on this machine: `make run` (python -m launch.local [KEY=VALUE ...]).

Builds the built-in tiny model if needed, writes RUN_DIR/config.yaml, starts the SGLang
server(s), the rollout controller and the trainer as separate processes (logs in RUN_DIR/logs/,
PIDs in RUN_DIR/pids.json), shows a progress bar from RUN_DIR/metrics.jsonl, and prints the
final line from summary.json. trainer=megatron (and trainer=fsdp) run trainer.tp_size * pp_size * dp_size trainer
processes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT as torchrun sets them): rank 0 logs to
logs/trainer.log, rank r > 0 to logs/trainer-<r>.log.

Faults: a rollout server that dies is restarted (rollout.max_server_restarts) and rejoins with
the current weights. `python -m launch.scale RUN_DIR +N|-N` adds or drains servers of the running
job (launch/run/elastic.py). If any trainer rank or the controller fails, everything is stopped (by PID),
the failing log is named, and running the same command again resumes from the last checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from areal_jobs.atomic import write_atomic
from areal_jobs.config import (
    ClusterKind,
    JobConfig,
    Placement,
    RewardSource,
    TrainerBackend,
    check_override_keys,
    register_configs,
    resolve_job_token,
    save_job_config,
    to_job_config,
)
from areal_jobs.logs import setup_logging
from areal_jobs.metrics import read_jsonl
from areal_jobs.report import final_line, length_table, source_table
from areal_jobs.rollout.server import cuda_available
from launch.planning import reward_files
from launch.planning.fit.gpu_shares import apply_shares, local_shares
from launch.planning.layout.placement import colocated_schedule
from launch.run.elastic import SCALE_FILE, ServerSet
from launch.run.preflight import (
    check_local_memory,
    check_lora_serving,
    check_reward_functions,
    check_reward_model,
    check_trainer_kernels,
    describe_policy,
    ensure_model,
    print_first_prompt,
)
from launch.run.replanner import Replanner, local_replanner

logger = logging.getLogger("launch.local")

_POLL_S = 1.0


@dataclass
class Role:
    name: str
    process: subprocess.Popen
    log: Path
    restarts: int = 0


def prepare_run_dir(run_dir: Path, resume: bool) -> bool:
    """Returns True when resuming. A finished run (or any run, with checkpoint.resume=false) under
    the same name is moved aside, never deleted, so nothing is lost."""
    from areal_jobs.checkpoint import latest_checkpoint

    finished = (run_dir / "summary.json").exists()
    if run_dir.exists() and any(run_dir.iterdir()) and (finished or not resume):
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = run_dir.with_name(f"{run_dir.name}.{stamp}")
        run_dir.rename(target)
        logger.info("previous run moved to %s", target)
    resuming = resume and run_dir.exists() and latest_checkpoint(run_dir) is not None
    # registrations of processes that no longer exist, drain markers and scale requests of the
    # last attempt (a restarted run starts rollout.num_servers servers again)
    for stale in ("servers", "reward_servers", "controller.json", SCALE_FILE):
        path = run_dir / stale
        if path.is_dir():
            for pattern in ("*.json", "*.drain", "*.drained"):
                for f in path.glob(pattern):
                    f.unlink()
        else:
            path.unlink(missing_ok=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    return resuming


def start_role(name: str, module: str, config: Path, env: dict[str, str], log: Path, *extra: str) -> Role:
    with log.open("ab") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--config", str(config), *extra],
            env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    logger.info("started %s (pid %d), log %s", name, proc.pid, log)
    return Role(name, proc, log)


def start_trainers(cfg: JobConfig, config: Path, env: dict[str, str], logs: Path) -> list[Role]:
    """One process per trainer rank, rank 0 first; they rendezvous on a free loopback port."""
    t = cfg.trainer
    if t.backend is TrainerBackend.torch:
        return [start_role("trainer", "areal_jobs.trainer.main", config, env, logs / "trainer.log")]
    from areal_jobs.transport.discovery import free_port

    world, port = t.tp_size * t.pp_size * t.dp_size, free_port("127.0.0.1")
    roles = []
    for rank in range(world):
        rank_env = dict(
            env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
        name = "trainer" if rank == 0 else f"trainer-{rank}"
        roles.append(start_role(name, "areal_jobs.trainer.main", config, rank_env, logs / f"{name}.log"))
    return roles


def stop_roles(roles: list[Role], timeout_s: float = 30.0) -> None:
    """SIGTERM each role's process group, then SIGKILL what is left after timeout_s."""
    for role in roles:
        if role.process.poll() is None:
            try:
                os.killpg(role.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    for role in roles:
        try:
            role.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(role.process.pid, signal.SIGKILL)
            role.process.wait(timeout=10)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def on_sigterm_interrupt() -> None:
    """SIGTERM (kill, a batch system, a CI timeout) stops the roles like Ctrl-C does: without it
    the servers, controller and trainers outlive launch.local as orphans."""
    signal.signal(signal.SIGTERM, _interrupt)


def launch(cfg: JobConfig) -> int:
    if cfg.cluster.kind is not ClusterKind.local:
        raise SystemExit("launch.local runs cluster=local only; submit cluster jobs with `make submit`")
    if cfg.cluster.placement is Placement.colocated:
        # every role already shares this machine's devices; colocated also means: never generate
        # while the trainer computes (a one-GPU box holds both, time-shared), and the servers free
        # their memory while it does
        logger.info(
            "cluster.placement=colocated: synchronous schedule (algo.max_staleness=0), the servers "
            "release their memory while the trainer steps"
        )
        cfg = colocated_schedule(cfg)
    cfg = check_reward_functions(cfg)
    t0 = time.time()
    run_dir = cfg.run.dir.resolve()
    ensure_model(cfg)  # the shared built-in model keeps the caller's permissions
    # everything the run writes from here on, by this process and every role it starts (they
    # inherit the umask), checkpoints included: 0700 / 0600, or group-readable (run.share_with_group)
    os.umask(cfg.run.umask)
    if prepare_run_dir(run_dir, cfg.checkpoint.resume):
        logger.info("resuming %s from its last checkpoint", run_dir)
    check_local_memory(cfg)
    check_lora_serving(cfg)
    check_trainer_kernels(cfg)
    check_reward_model(cfg)
    run_dir.chmod(cfg.run.dir_mode)  # a directory an older version left 0755
    reward_files.record(cfg, run_dir)  # a copy of each reward function file, with its sha256
    print_first_prompt(cfg)
    print(describe_policy(cfg), flush=True)
    if cuda_available():  # every server and trainer rank 0 share GPU 0 here: divide its memory
        shares = local_shares(cfg)
        cfg = apply_shares(cfg, shares)
        logger.info("%s", shares.describe())
    config_path = run_dir / "config.yaml"
    save_job_config(cfg, config_path)  # without run.token
    token, source = resolve_job_token(cfg.run, os.environ)
    logger.info("job token: %s", source)
    env = dict(os.environ, AREAL_JOB_TOKEN=token or secrets.token_hex(16), AREAL_JOB_START_TIME=str(t0))
    env.setdefault("AREAL_BIND_HOST", "127.0.0.1")
    env.setdefault("OMP_NUM_THREADS", str(cfg.trainer.threads))
    logs = run_dir / "logs"

    def start_server(i: int) -> Role:
        return start_role(
            f"server{i}",
            "areal_jobs.rollout.server",
            config_path,
            env,
            logs / f"server-{i}.log",
            "--index",
            str(i),
        )

    servers = ServerSet(
        run_dir, start_server, stop_roles, cfg.rollout.max_server_restarts, cfg.rollout.num_servers
    )
    # the reward-model servers: a fixed set that heals like the rollout servers (restarted in
    # place, under their index; the scorer finds the new registration)
    reward_servers = None
    if cfg.reward.source is not RewardSource.verifier:

        def start_reward_server(i: int) -> Role:
            return start_role(
                f"reward-server{i}", "areal_jobs.rollout.reward_server", config_path, env,
                logs / f"reward-server-{i}.log", "--index", str(i),
            )  # fmt: skip

        reward_servers = ServerSet(
            run_dir, start_reward_server, stop_roles, cfg.rollout.max_server_restarts,
            cfg.reward.model.num_servers, scalable=False,
        )  # fmt: skip
    controller = start_role(
        "controller", "areal_jobs.rollout.main", config_path, env, logs / "controller.log"
    )
    trainers = start_trainers(cfg, config_path, env, logs)
    replanner = local_replanner(cfg, run_dir)
    on_sigterm_interrupt()
    try:
        failed = _watch(
            servers, controller, trainers, run_dir, cfg.trainer.total_steps, replanner, reward_servers
        )
    except KeyboardInterrupt:
        failed = "interrupted"
    finally:
        stop_roles([*servers.roles, *(reward_servers.roles if reward_servers else []), controller, *trainers])
    if failed:
        logger.error("run failed: %s. Run the same command again to resume from the last checkpoint.", failed)
        return 1
    if not (run_dir / "summary.json").exists():
        logger.warning(
            "the trainer checkpointed and stopped (preempted); run the same command again to resume"
        )
        return 3
    summary = json.loads((run_dir / "summary.json").read_text())
    print(final_line(summary), flush=True)
    if summary.get("by_length"):
        print(
            "held-out accuracy by chain length (start -> end of RL):\n" + length_table(summary["by_length"])
        )
    if summary.get("by_source"):
        print("per source (held-out accuracy start -> end; training reward/accuracy, last batches):\n"
              + source_table(summary["by_source"]))  # fmt: skip
    print(f"run directory: {run_dir} (summary.json, metrics.jsonl, reward_accuracy.png, final_hf/, logs/)")
    return 0


def _watch(
    servers: ServerSet,
    controller: Role,
    trainers: list[Role],
    run_dir: Path,
    total_steps: int,
    replanner: Replanner | None = None,
    reward_servers: ServerSet | None = None,
) -> str | None:
    """Progress bar until the trainer exits; heals and scales the servers; returns why the run failed.

    `trainers` are the trainer ranks, rank 0 first. A trainer rank > 0 or the controller exits 0
    only once rank 0 has said Stop; any non-zero exit fails the run."""
    from tqdm import tqdm

    trainer = trainers[0]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    done = sum(1 for r in rows if "train/version" in r)
    bar = tqdm(total=total_steps, initial=done, desc="RL", unit="step", dynamic_ncols=True, mininterval=2.0)
    seen, postfix = len(rows), {}
    sets = [servers, *([reward_servers] if reward_servers else [])]

    def roles() -> list[Role]:
        return [*(r for s in sets for r in s.roles), controller, *trainers]

    _write_pids(run_dir, roles())
    try:
        while True:
            if trainer.process.poll() == 0:
                failed = _wait_all(trainers[1:], 120, "after trainer rank 0")
                if failed:
                    return failed
                try:
                    code = controller.process.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    return f"the controller did not exit within 120s after the trainer; see {controller.log}"
                return None if code == 0 else f"controller exited with code {code}; see {controller.log}"
            for role in (*trainers, controller):
                code = role.process.poll()
                if code is not None and code != 0:
                    return f"{role.name} exited with code {code}; see {role.log}"
            if controller.process.poll() == 0:  # it leaves first after Stop: give the trainer time to finish
                return _wait_all(trainers, 600, "after the controller stopped")
            for server_set in sets:
                failed, changed = server_set.poll()
                if failed:
                    return failed
                if changed:
                    _write_pids(run_dir, roles())
            rows = read_jsonl(run_dir / "metrics.jsonl")
            if replanner is not None:
                replanner.observe(rows[seen:])
            for row in rows[seen:]:
                postfix.update(_postfix(row))
                if "train/version" in row:
                    bar.update(1)
            if len(rows) > seen:
                bar.set_postfix(postfix)
            seen = len(rows)
            time.sleep(_POLL_S)
    finally:
        bar.close()


def _wait_all(roles: list[Role], timeout_s: float, when: str) -> str | None:
    """Wait for every role to exit; why the run failed, or None if all exited 0 in time."""
    deadline = time.monotonic() + timeout_s
    for role in roles:
        try:
            code = role.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return f"{role.name} did not finish within {timeout_s:.0f}s {when}; see {role.log}"
        if code != 0:
            return f"{role.name} exited with code {code}; see {role.log}"
    return None


def _write_pids(run_dir: Path, roles: list[Role]) -> None:
    # tests and `launch.run.scale` poll this file while the launcher rewrites it (elastic servers)
    write_atomic(run_dir / "pids.json", json.dumps({r.name: r.process.pid for r in roles}))


def _postfix(row: dict) -> dict[str, str]:
    out = {}
    if "reward/mean" in row:
        out["reward"] = f"{row['reward/mean']:.2f}"
    if "eval/accuracy" in row:
        out["acc"] = f"{row['eval/accuracy']:.2f}"
    if "staleness/mean" in row:
        out["lag"] = f"{row['staleness/mean']:.1f}/{row['staleness/max']:.0f}"
    if "staleness/bound" in row:  # the admission bound in force (algo.max_staleness=auto moves it)
        out["eta"] = f"{row['staleness/bound']:.0f}"
    if "throughput/trained_tokens_per_s" in row:
        out["tok/s"] = f"{row['throughput/trained_tokens_per_s']:.0f}"
    preclip = row.get("offpolicy/preclip_fraction")
    if preclip is not None and math.isfinite(preclip):
        # the staleness mechanism at a glance (docs/objective.md, "How much staleness can I allow?")
        out["preclip"] = f"{100 * preclip:.1f}%"
    return out


register_configs()


def refuse_unknown_overrides(argv: list[str], conf_dir: Path) -> None:
    """Exit, naming the closest real key, for an override of a key the schema lacks."""
    try:
        check_override_keys(argv, conf_dir, JobConfig)
    except ValueError as exc:
        raise SystemExit(f"invalid configuration: {exc}") from None


def main(dcfg: DictConfig) -> None:
    """`python -m launch.local`: the door (launch/local.py) holds Hydra's entry point."""
    setup_logging("launch")
    try:
        cfg = to_job_config(dcfg)
    except ValueError as exc:  # a __post_init__ check: it names the override to change
        raise SystemExit(f"invalid configuration: {exc}") from None
    sys.exit(launch(cfg))
