"""Run the whole job on this machine: `make run` (python -m launch.local [KEY=VALUE ...]).

Builds the built-in tiny model if needed, writes RUN_DIR/config.yaml, starts the SGLang
server(s), the rollout controller and the trainer as separate processes (logs in RUN_DIR/logs/),
shows a progress bar from RUN_DIR/metrics.jsonl, and prints the final line from summary.json.
If any process fails, the others are stopped (by PID) and the failing log is named.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
from omegaconf import DictConfig

from areal_jobs.config import ClusterKind, JobConfig, register_configs, save_job_config, to_job_config
from areal_jobs.logs import setup_logging
from areal_jobs.metrics import read_jsonl
from areal_jobs.report import final_line

logger = logging.getLogger("launch.local")

_POLL_S = 1.0


@dataclass
class Role:
    name: str
    process: subprocess.Popen
    log: Path


def prepare_run_dir(run_dir: Path) -> None:
    """A finished run under the same name is moved aside (never deleted), so nothing is lost."""
    if (run_dir / "summary.json").exists():
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime((run_dir / "summary.json").stat().st_mtime))
        target = run_dir.with_name(f"{run_dir.name}.{stamp}")
        run_dir.rename(target)
        logger.info("previous finished run moved to %s", target)
    for stale in ("servers", "controller.json"):  # registrations of processes that no longer exist
        path = run_dir / stale
        if path.is_dir():
            for f in path.glob("*.json"):
                f.unlink()
        else:
            path.unlink(missing_ok=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)


def ensure_model(cfg: JobConfig) -> None:
    if cfg.model.path:
        if not (Path(cfg.model.path) / "config.json").exists():
            raise SystemExit(f"model.path={cfg.model.path} has no config.json: point it at a Hugging Face model directory")
        return
    from areal_jobs.data.tiny_model import TinyRecipe, build_builtin_model

    build_builtin_model(Path(cfg.model.builtin_dir), TinyRecipe(sft_steps=cfg.model.builtin_sft_steps))


def start_role(name: str, module: str, config: Path, env: dict[str, str], log: Path, *extra: str) -> Role:
    with log.open("ab") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--config", str(config), *extra],
            env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    logger.info("started %s (pid %d), log %s", name, proc.pid, log)
    return Role(name, proc, log)


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


def launch(cfg: JobConfig) -> int:
    if cfg.cluster.kind is not ClusterKind.local:
        raise SystemExit("launch.local runs cluster=local only; submit cluster jobs with `make submit`")
    t0 = time.time()
    run_dir = cfg.run.dir.resolve()
    prepare_run_dir(run_dir)
    ensure_model(cfg)
    config_path = run_dir / "config.yaml"
    save_job_config(cfg, config_path)
    env = dict(os.environ, AREAL_JOB_TOKEN=cfg.run.token or secrets.token_hex(16), AREAL_JOB_START_TIME=str(t0))
    env.setdefault("AREAL_BIND_HOST", "127.0.0.1")
    env.setdefault("OMP_NUM_THREADS", str(cfg.trainer.threads))
    logs = run_dir / "logs"
    roles = [
        start_role(f"server{i}", "areal_jobs.rollout.server", config_path, env, logs / f"server-{i}.log", "--index", str(i))
        for i in range(cfg.rollout.num_servers)
    ]
    roles.append(start_role("controller", "areal_jobs.rollout.main", config_path, env, logs / "controller.log"))
    roles.append(start_role("trainer", "areal_jobs.trainer.main", config_path, env, logs / "trainer.log"))
    trainer, controller = roles[-1], roles[-2]
    try:
        failed = _watch(roles, trainer, controller, run_dir, cfg.trainer.total_steps)
    except KeyboardInterrupt:
        failed = "interrupted"
    finally:
        stop_roles(roles)
    if failed:
        logger.error("run failed: %s", failed)
        return 1
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    print(final_line(summary), flush=True)
    print(f"run directory: {run_dir} (summary.json, metrics.jsonl, reward_accuracy.png, final_hf/, logs/)")
    return 0


def _watch(roles: list[Role], trainer: Role, controller: Role, run_dir: Path, total_steps: int) -> str | None:
    """Progress bar until the trainer exits; returns why the run failed, or None."""
    from tqdm import tqdm

    bar = tqdm(total=total_steps, desc="RL", unit="step", dynamic_ncols=True)
    seen, postfix = 0, {}
    try:
        while True:
            for role in roles:
                code = role.process.poll()
                if code is not None and (code != 0 or role not in (trainer, controller)):
                    if role is trainer and code == 0:
                        continue
                    return f"{role.name} exited with code {code}; see {role.log}"
            rows = read_jsonl(run_dir / "metrics.jsonl")
            for row in rows[seen:]:
                postfix.update(_postfix(row))
                if "train/version" in row:
                    bar.update(1)
            seen = len(rows)
            if postfix:
                bar.set_postfix(postfix, refresh=False)
            bar.refresh()
            if trainer.process.poll() == 0:
                controller.process.wait(timeout=60)
                return None
            time.sleep(_POLL_S)
    finally:
        bar.close()


def _postfix(row: dict) -> dict[str, str]:
    out = {}
    if "reward/mean" in row:
        out["reward"] = f"{row['reward/mean']:.2f}"
    if "eval/accuracy" in row:
        out["acc"] = f"{row['eval/accuracy']:.2f}"
    if "staleness/mean" in row:
        out["lag"] = f"{row['staleness/mean']:.1f}/{row['staleness/max']:.0f}"
    if "throughput/trained_tokens_per_s" in row:
        out["tok/s"] = f"{row['throughput/trained_tokens_per_s']:.0f}"
    return out


register_configs()


@hydra.main(config_path="../conf", config_name="local", version_base=None)
def main(dcfg: DictConfig) -> None:
    setup_logging("launch")
    try:
        cfg = to_job_config(dcfg)
    except ValueError as exc:  # a __post_init__ check: it names the override to change
        raise SystemExit(f"invalid configuration: {exc}") from None
    sys.exit(launch(cfg))


if __name__ == "__main__":
    main()
