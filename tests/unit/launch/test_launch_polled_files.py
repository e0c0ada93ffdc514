"""Files the launcher rewrites while other processes poll them (pids.json, the scale target, the
satellite list) are never seen half-written. A CI run once read pids.json empty: the launcher
rewrote it with a plain truncate-and-write while the elastic test polled it."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from areal_jobs.metrics import read_jsonl
from launch.run.elastic import SCALE_FILE, write_target
from launch.run.local import _write_pids
from launch.slurm.satellites import SATELLITES_FILE, Satellite, write_satellites

NUM_WRITES = 1500


def _roles(n: int) -> list:
    return [SimpleNamespace(name=f"server{i}", process=SimpleNamespace(pid=1000 + i)) for i in range(n)]


WRITERS = {
    "pids": ("pids.json", lambda d, i: _write_pids(d, _roles(1 + i % 3))),
    "scale": (SCALE_FILE, lambda d, i: write_target(d, 1 + i % 3)),
    "satellites": (SATELLITES_FILE, lambda d, i: write_satellites(d, [Satellite(str(i), 1, 1 + i % 3)])),
}


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_a_polling_reader_never_sees_a_partial_file(tmp_path, name):
    filename, write = WRITERS[name]
    write(tmp_path, 0)
    done = threading.Event()

    def writer():
        try:
            for i in range(NUM_WRITES):
                write(tmp_path, i)
        finally:
            done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    num_reads = 0
    try:
        while not done.is_set() and num_reads < 50 * NUM_WRITES:
            json.loads((tmp_path / filename).read_text())  # raises on an empty or torn file
            num_reads += 1
    finally:
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert num_reads > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [filename], "a temporary file was left behind"


def test_read_jsonl_leaves_a_row_still_being_written_for_the_next_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    row = json.dumps({"step": 2, "train/version": 2})
    path.write_text(json.dumps({"step": 1}) + "\n" + row[:9])  # the trainer's second write not yet in
    assert read_jsonl(path) == [{"step": 1}]
    path.write_text(json.dumps({"step": 1}) + "\n" + row + "\n")
    assert read_jsonl(path) == [{"step": 1}, {"step": 2, "train/version": 2}]
