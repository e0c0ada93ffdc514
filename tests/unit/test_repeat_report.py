"""tests/repeat.py (`make test-repeat`): a test that fails in one repetition out of three is
reported with its count and its failure, and the exit code says so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import repeat  # noqa: E402  (tests/repeat.py)

FLAKY = """
from pathlib import Path

COUNTER = Path(__file__).with_name("runs.txt")


def test_steady():
    assert True


def test_fails_in_the_second_run():
    runs = int(COUNTER.read_text()) + 1 if COUNTER.exists() else 1
    COUNTER.write_text(str(runs))
    assert runs != 2, "the second run's failure"
"""


def test_a_failure_in_one_repetition_is_reported_and_fails_the_command(tmp_path, capsys):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_flaky.py").write_text(FLAKY)
    code = repeat.main(["--runs", "3", "--workers", "0", "--out", str(tmp_path / "out"), str(suite)])
    assert code == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    (failed,) = summary["failed"]
    assert failed.endswith("test_fails_in_the_second_run")
    assert [f["run"] for f in summary["failed"][failed]] == [2]
    assert "the second run's failure" in summary["failed"][failed][0]["failure"]
    assert "failed in 1 of 3 runs" in capsys.readouterr().out


def test_steady_runs_pass(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_ok.py").write_text("def test_ok():\n    assert True\n")
    assert repeat.main(["--runs", "2", "--workers", "0", "--out", str(tmp_path / "out"), str(suite)]) == 0
