"""Service discovery through the run directory (a shared filesystem on clusters).

Each rollout server writes RUN_DIR/servers/<index>.json = {"index", "host", "port"} once it is
healthy, atomically (write + rename), and removes it on exit. The controller waits for the
expected number of records. The same mechanism serves local runs and SLURM jobs. Reward-model
servers (reward.model.*) register the same way under RUN_DIR/reward_servers/ (REWARD_SERVERS). A server asked
to leave the running job gets a RUN_DIR/servers/<index>.drain marker; the controller answers with
<index>.drained once none of its requests is in flight (launch.scale).
"""

from __future__ import annotations

import json
import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from areal_jobs.atomic import write_atomic


@dataclass(frozen=True)
class ServerRecord:
    index: int
    host: str
    port: int
    pid: int = 0  # the SGLang process (its group is the whole server), for operators and fault tests

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


SERVERS = "servers"  # rollout servers
REWARD_SERVERS = "reward_servers"  # reward-model servers


def servers_dir(run_dir: Path, folder: str = SERVERS) -> Path:
    return Path(run_dir) / folder


def register_server(
    run_dir: Path, index: int, host: str, port: int, pid: int = 0, folder: str = SERVERS
) -> None:
    folder = servers_dir(run_dir, folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(
        folder / f"{index}.json", json.dumps({"index": index, "host": host, "port": port, "pid": pid})
    )


def unregister_server(run_dir: Path, index: int, folder: str = SERVERS) -> None:
    (servers_dir(run_dir, folder) / f"{index}.json").unlink(missing_ok=True)


def request_drain(run_dir: Path, index: int) -> None:
    """Ask the controller to stop sending work to server `index` and let it go (launch.scale -N)."""
    servers_dir(run_dir).mkdir(parents=True, exist_ok=True)
    (servers_dir(run_dir) / f"{index}.drain").touch()


def leaving(run_dir: Path) -> set[int]:
    """Servers asked to leave (draining) or already let go: never admitted again under that index."""
    folder = servers_dir(run_dir)
    return {int(p.stem) for pattern in ("*.drain", "*.drained") for p in folder.glob(pattern)}


def mark_drained(run_dir: Path, index: int) -> None:
    """The controller's answer: nothing of server `index` is in flight; its process may stop."""
    (servers_dir(run_dir) / f"{index}.drained").touch()


def is_drained(run_dir: Path, index: int) -> bool:
    return (servers_dir(run_dir) / f"{index}.drained").exists()


def read_servers(run_dir: Path, folder: str = SERVERS) -> list[ServerRecord]:
    records = []
    for path in sorted(servers_dir(run_dir, folder).glob("*.json")):
        try:
            raw = json.loads(path.read_text())
            records.append(
                ServerRecord(int(raw["index"]), str(raw["host"]), int(raw["port"]), int(raw.get("pid", 0)))
            )
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"bad server record {path}: {exc}; delete it and restart that server") from None
    return sorted(records, key=lambda r: r.index)


def wait_for_servers(
    run_dir: Path, count: int, timeout_s: float, poll_s: float = 0.5, folder: str = SERVERS
) -> list[ServerRecord]:
    """Block until `count` servers registered; TimeoutError names how many are missing."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_servers(run_dir, folder)
        if len(records) >= count:
            return records
        if time.monotonic() > deadline:
            seen = sorted(r.index for r in records)
            kind = "reward-model" if folder == REWARD_SERVERS else "rollout"
            raise TimeoutError(
                f"only {len(records)}/{count} {kind} servers registered in {servers_dir(run_dir, folder)} after "
                f"{timeout_s:.0f}s (seen {seen}); check logs/sglang-*.log or raise control.server_start_deadline_s"
            )
        time.sleep(poll_s)


def register_controller(run_dir: Path, host: str, traj_port: int, ctrl_port: int) -> None:
    """RUN_DIR/controller.json: where trainers connect (local mode; SLURM passes it by env too)."""
    write_atomic(
        Path(run_dir) / "controller.json",
        json.dumps({"host": host, "traj_port": traj_port, "ctrl_port": ctrl_port}),
    )


def wait_for_controller(run_dir: Path, timeout_s: float, poll_s: float = 0.5) -> tuple[str, int, int]:
    path = Path(run_dir) / "controller.json"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the rollout controller did not register {path} within {timeout_s:.0f}s; see logs/controller.log"
            )
        time.sleep(poll_s)
    raw = json.loads(path.read_text())
    return str(raw["host"]), int(raw["traj_port"]), int(raw["ctrl_port"])


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (the caller binds it soon after; a small race is accepted)."""
    return free_ports(host, 1)[0]


def free_ports(host: str, count: int, consecutive: bool = False, attempts: int = 200) -> list[int]:
    """`count` distinct ports free right now, below the kernel's ephemeral range.

    A server may bind its port tens of seconds after we pick it (SGLang loads the model first);
    an ephemeral port could meanwhile become the source port of some outgoing connection.
    Ports below the ephemeral range are only ever taken by explicit binds.
    """
    low, high = 20000, _ephemeral_low() - 1
    rng = random.Random()
    for _ in range(attempts):
        if consecutive:
            start = rng.randint(low, high - count)
            ports = list(range(start, start + count))
        else:
            ports = rng.sample(range(low, high), count)
        socks = []
        try:
            for port in ports:
                sock = socket.socket()
                socks.append(sock)
                sock.bind((host, port))
            return ports
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} free ports in {low}..{high} on {host}")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
