"""launch.local's server set: restarts the dead, grows and drains on launch.scale's request.
Stand-in processes (the whole path with real servers: tests/integration/e2e/test_e2e_elastic.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from areal_jobs.transport import discovery
from launch.run.elastic import ServerSet, read_target, write_target
from launch.run.scale import current_servers, main, parse_change


class Process:
    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code


@dataclass
class FakeRole:
    name: str
    process: Process = field(default_factory=Process)
    log: Path = Path("server.log")
    restarts: int = 0


def server_set(run_dir: Path, num_servers: int = 2, max_restarts: int = 1):
    started, stopped = [], []

    def start(index: int) -> FakeRole:
        started.append(index)
        return FakeRole(f"server{index}")

    return ServerSet(run_dir, start, stopped.extend, max_restarts, num_servers), started, stopped


def test_a_dead_server_restarts_under_its_index_until_the_budget_is_spent(tmp_path):
    servers, started, _ = server_set(tmp_path)
    servers.servers[1].process.code = -9
    assert servers.poll() == (None, True)
    assert started == [0, 1, 1] and servers.servers[1].restarts == 1
    servers.servers[1].process.code = -9
    failed, _ = servers.poll()
    assert failed.startswith("server1 died 2 times (last code -9)")


def test_growing_starts_fresh_indices(tmp_path):
    servers, started, _ = server_set(tmp_path)
    assert servers.poll() == (None, False)  # nothing asked
    write_target(tmp_path, 4)
    assert servers.poll() == (None, True)
    assert started == [0, 1, 2, 3] and servers.serving == [0, 1, 2, 3]
    assert servers.poll() == (None, False)  # asked once, done once


def test_shrinking_drains_then_stops_only_once_the_controller_answered(tmp_path):
    servers, _, stopped = server_set(tmp_path, num_servers=3)
    discovery.register_server(tmp_path, 2, "127.0.0.1", 1234)
    write_target(tmp_path, 2)
    assert servers.poll() == (None, False)
    assert discovery.leaving(tmp_path) == {2} and servers.serving == [0, 1] and stopped == []
    assert servers.poll() == (None, False)  # still draining: the process keeps running
    discovery.mark_drained(tmp_path, 2)
    assert servers.poll() == (None, True)
    assert [r.name for r in stopped] == ["server2"] and sorted(servers.servers) == [0, 1]
    assert [r.index for r in discovery.read_servers(tmp_path)] == []  # its registration is gone
    write_target(tmp_path, 3)
    servers.poll()
    assert sorted(servers.servers) == [0, 1, 3]  # an index is never reused within a run


def test_a_draining_server_that_dies_is_released_not_restarted(tmp_path):
    servers, started, stopped = server_set(tmp_path)
    write_target(tmp_path, 1)
    servers.poll()
    servers.servers[1].process.code = 1
    assert servers.poll() == (None, True)
    assert started == [0, 1] and [r.name for r in stopped] == ["server1"]


def test_scale_cli_changes_relative_to_what_runs(tmp_path, capsys):
    assert parse_change("+2", 1) == 3 and parse_change("-1", 3) == 2 and parse_change("4", 1) == 4
    with pytest.raises(ValueError, match=r"write \+N, -N or N"):
        parse_change("more", 1)
    for index in range(2):
        discovery.register_server(tmp_path, index, "127.0.0.1", 1000 + index)
    assert current_servers(tmp_path) == 2
    (tmp_path / "pids.json").write_text("{}")
    (tmp_path / "config.yaml").write_text("cluster:\n  kind: local\n")
    assert main([str(tmp_path), "+1"]) == 0
    assert read_target(tmp_path) == 3
    assert json.loads(capsys.readouterr().out)["num_servers"] == 3
    with pytest.raises(SystemExit):
        main([str(tmp_path), "-3"])  # no server left: refused, nothing written
    assert read_target(tmp_path) == 3


def test_the_reward_model_servers_heal_but_do_not_follow_launch_scale(tmp_path):
    """launch.local's second set (scalable=False): a dead reward-model server restarts under its
    index like a rollout server; scale.json sizes only the rollout servers."""
    started = []

    def start(index: int) -> FakeRole:
        started.append(index)
        return FakeRole(f"reward-server{index}")

    rewards = ServerSet(tmp_path, start, lambda roles: None, 2, 1, scalable=False)
    write_target(tmp_path, 3)
    assert rewards.poll() == (None, False) and started == [0]
    rewards.servers[0].process.code = -9
    assert rewards.poll() == (None, True)
    assert started == [0, 0] and rewards.servers[0].restarts == 1
