"""samples.jsonl: one line per sample with prompt, response, reward, status, version span, stop reason."""

import json
import logging

import numpy as np

from areal_jobs.samples import SampleDump, train_records
from areal_jobs.transport import messages as m


def sample(sid, out, versions, reward, status, reason):
    return m.SampleTrajectory(
        sample_id=sid, output_ids=np.array(out, dtype=np.int32), logprobs=np.zeros(len(out), dtype=np.float32),
        versions=np.array(versions, dtype=np.int32), reward=reward, reward_status=status,
        finish_reason=reason, num_interruptions=0,
    )  # fmt: skip


def test_train_records_are_appended_and_the_first_logged(tmp_path, caplog):
    group = m.TrajectoryGroup(
        group_id="g3", data_index=3, prompt_ids=np.array([1, 2], dtype=np.int32),
        samples=(sample("g3/0", [5, 6, 0], [4, 5, 5], 1.0, "ok", "stop"),
                 sample("g3/1", [7], [6], 0.0, "timeout", "length")),
        gen_time_s=0.0, reward_time_s=0.0,
    )  # fmt: skip
    decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)  # noqa: E731
    dump = SampleDump(tmp_path / "samples.jsonl", print_first=1)
    with caplog.at_level(logging.INFO, logger="areal_jobs.samples"):
        dump.write(train_records(10, [group], decode))
        dump.write(train_records(20, [group], decode)[1:])
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows[0] == {
        "kind": "train", "step": 10, "prompt": "bc", "response": "fga", "reward": 1.0,
        "reward_status": "ok", "version_min": 4, "version_max": 5, "stop_reason": "stop",
    }  # fmt: skip
    assert [(r["step"], r["response"], r["version_min"], r["stop_reason"]) for r in rows[1:]] == [
        (10, "h", 6, "length"),
        (20, "h", 6, "length"),
    ]
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and "PROMPT: bc" in logged[0] and "RESPONSE: h" in logged[1]
