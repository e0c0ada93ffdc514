"""areal_jobs.atomic.write_atomic: whole files, the usual mode, no temporary left behind."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from areal_jobs.atomic import write_atomic


def test_replaces_whole_and_leaves_only_the_file(tmp_path):
    path = tmp_path / "latest"
    write_atomic(path, "step_1")
    write_atomic(path, b"step_2", durable=True)
    assert path.read_text() == "step_2"
    assert os.listdir(tmp_path) == ["latest"]


def test_mode_is_what_a_plain_write_gives(tmp_path):
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "a", "x")
        (tmp_path / "b").write_text("x")
    finally:
        os.umask(old)
    modes = {stat.S_IMODE((tmp_path / n).stat().st_mode) for n in "ab"}
    assert modes == {0o640}


def test_concurrent_writers_of_one_path_each_write_whole(tmp_path):
    path = tmp_path / "progress"
    payloads = [str(i) * 10_000 for i in range(8)]
    threads = [threading.Thread(target=write_atomic, args=(path, p)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert path.read_text() in payloads
    assert os.listdir(tmp_path) == ["progress"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "meta.json"
    write_atomic(path, "old")
    with pytest.raises(TypeError):
        write_atomic(path, 3)  # not bytes or str
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["meta.json"]
