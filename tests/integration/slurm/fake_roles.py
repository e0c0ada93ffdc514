"""Stand-in for `python -m areal_jobs.<role> --config ... [--index I]` inside the rendered job.

Set as `cluster.python` (through a small wrapper script), it checks the sbatch side of the runtime
contract without SGLang or a model: each role records the environment the script gave it, the
servers bind and register like real ones, and the trainer counts steps, checkpoints on SIGUSR1
(exit 0) and resumes from that checkpoint, as the real roles do.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import yaml

from areal_jobs.atomic import write_atomic

STEP_S = 0.3  # pacing of the fake trainer, so a test can signal it mid-run
# Once RUN_DIR/fake/hurry exists (a test saw what it waited for: a lost node handled, a satellite
# registered), the trainer's remaining steps take HURRY_STEP_S each: the job ends when the test is
# done with it, not after a length fixed in advance; the steps and their count are the same.
HURRY_STEP_S = 0.01
ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "AREAL_BIND_HOST",
    "AREAL_CONTROLLER_HOST",
    "AREAL_JOB_TOKEN",
    "CUDA_VISIBLE_DEVICES",
    "SLURM_PROCID",
    "SLURMD_NODENAME",
    "SLURM_RESTART_COUNT",
    "NCCL_SOCKET_IFNAME",
)


class Checkpoint(Exception):
    pass


def _record(run_dir: Path, name: str) -> None:
    attempt = os.environ.get("SLURM_RESTART_COUNT", "0")
    out = run_dir / "fake" / f"{name}.attempt{attempt}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({key: os.environ.get(key) for key in ENV_KEYS}))


def _on_usr1(*_: object) -> None:
    raise Checkpoint


def hurry(run_dir: Path) -> None:
    """From now on, the fake trainer of the run at `run_dir` (this attempt and the next) steps at
    HURRY_STEP_S."""
    (run_dir / "fake").mkdir(exist_ok=True)
    (run_dir / "fake" / "hurry").touch()


def server(cfg: dict, run_dir: Path, index: int) -> None:
    host = os.environ.get("AREAL_BIND_HOST", "127.0.0.1")
    port = cfg["rollout"]["base_port"] + index
    _record(run_dir, f"server{index}")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
        entry = run_dir / "servers" / f"{index}.json"
        entry.write_text(json.dumps({"index": index, "host": host, "port": port}))
        print(f"server {index} listening on {host}:{port}", flush=True)
        if (run_dir / "fake" / f"crash_server{index}").exists():  # a test's failure injection
            time.sleep(1)
            sys.exit(f"server {index}: injected crash")
        signal.sigwait({signal.SIGTERM})  # until the script stops the servers
    print(f"server {index} stopped", flush=True)


def controller(cfg: dict, run_dir: Path) -> None:
    # the handler first, as the real controller does: under load the trainer can be steps ahead
    # before the servers register, and a USR1 then must not kill the controller (default action)
    signal.signal(signal.SIGUSR1, _on_usr1)
    _record(run_dir, "controller")
    want = cfg["rollout"]["num_servers"]
    try:
        while len(list((run_dir / "servers").glob("*.json"))) < want:
            time.sleep(0.1)
        print(f"controller: {want} servers registered", flush=True)
        while not (run_dir / "fake" / "trainer_done").exists():
            time.sleep(0.1)
        print("controller: trainer done", flush=True)
    except Checkpoint:
        (run_dir / "fake" / "controller_state.json").write_text("{}")
        print("controller: state saved on USR1", flush=True)


def trainer(cfg: dict, run_dir: Path) -> None:
    _record(run_dir, f"trainer{os.environ['RANK']}")
    ckpt = run_dir / "checkpoints" / "fake_step"
    start = int(ckpt.read_text()) if ckpt.exists() else 0
    print(f"trainer: starting at step {start}", flush=True)
    signal.signal(signal.SIGUSR1, _on_usr1)
    step = start
    try:
        while step < cfg["trainer"]["total_steps"]:
            time.sleep(HURRY_STEP_S if (run_dir / "fake" / "hurry").exists() else STEP_S)
            step += 1
            # tmp + rename: the test polls this file and must never read it half written
            write_atomic(run_dir / "fake" / "progress", str(step))  # a tmp name per writer: no race
    except Checkpoint:
        ckpt.parent.mkdir(exist_ok=True)
        ckpt.write_text(str(step))
        print(f"trainer: checkpoint at step {step}", flush=True)
        return
    (run_dir / "summary.json").write_text(json.dumps({"start_step": start, "final_step": step}))
    (run_dir / "fake" / "trainer_done").touch()
    print(f"trainer: done at step {step}", flush=True)


def main(argv: list[str]) -> None:
    module = argv[argv.index("-m") + 1]
    if module == "launch.run.replanner":  # the job script's re-planner: nothing to measure here
        print("fake re-planner: nothing to do", flush=True)
        return
    cfg = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())
    run_dir = Path(os.environ["AREAL_RUN_DIR"])
    if module == "areal_jobs.rollout.supervise":  # the real supervisor, around a stand-in server
        from areal_jobs.rollout import supervise

        stand_in = [sys.executable, __file__, *argv]
        stand_in[stand_in.index("-m") + 1] = "areal_jobs.rollout.server"
        sys.exit(supervise.main(argv[argv.index("-m") + 2 :], command=stand_in))
    if module == "areal_jobs.rollout.server":
        server(cfg, run_dir, int(argv[argv.index("--index") + 1]))
    elif module == "areal_jobs.rollout.main":
        controller(cfg, run_dir)
    elif module == "areal_jobs.trainer.main":
        trainer(cfg, run_dir)
    else:
        sys.exit(f"fake_roles: unknown module {module}")


if __name__ == "__main__":
    main(sys.argv[1:])
