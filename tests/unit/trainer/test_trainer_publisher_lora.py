"""model.lora.ship=adapter on trainer rank 0: each version's adapters are written once as a PEFT
directory, the PauseRequest names it, nothing is broadcast, the bytes are the adapter file's, and
old directories are pruned. Scripted controller (the real one: tests/integration/vllm/test_vllm_lora.py)."""

from __future__ import annotations

from pathlib import Path

from test_trainer_inbox import ScriptedChannel
from test_trainer_publisher_retry import SENDER, Ranks, Stage

from areal_jobs.config import WeightSyncConfig
from areal_jobs.trainer.intake.inbox import Inbox
from areal_jobs.trainer.publish.publisher import ADAPTER_DIRS_KEPT, WeightPublisher
from areal_jobs.transport import codec
from areal_jobs.transport import messages as m


class AdapterBackend:
    """Writes a fake PEFT directory of `size` bytes where it is told to."""

    def __init__(self, size: int) -> None:
        self.size, self.saved = size, []

    def save_adapter(self, path: str) -> None:
        self.saved.append(path)
        Path(path).mkdir(parents=True)
        (Path(path) / "adapter_model.safetensors").write_bytes(b"x" * self.size)
        (Path(path) / "adapter_config.json").write_text("{}")


def test_adapters_travel_as_a_directory_and_old_ones_are_pruned(tmp_path):
    versions = range(1, ADAPTER_DIRS_KEPT + 3)
    replies = []
    for v in versions:
        replies += [
            m.Paused(v, world_size=2, init_group=False, group_generation=0),
            m.VersionPublished(v, 0.1),
        ]
    controller = ScriptedChannel(*replies)
    stage, backend = Stage(failures=0), AdapterBackend(size=1234)
    pub = WeightPublisher(
        WeightSyncConfig(step_timeout_s=2.0), Inbox(controller), Ranks(), stage, (SENDER,), tmp_path / "w",
        adapter_dir=tmp_path / "lora",
    )  # fmt: skip
    metrics = [pub.publish(v, backend, trained=()) for v in versions]
    requests = [x for x in controller.sent if isinstance(x, m.PauseRequest)]
    assert [r.adapter_path for r in requests] == [str(tmp_path / "lora" / f"v{v}") for v in versions]
    assert all(not r.disk_path for r in requests) and backend.saved == [r.adapter_path for r in requests]
    assert stage.sent == [] and pub.channel.sent == []  # no broadcast, no Publish to other ranks
    assert all(x["weight_sync/bytes"] == 1234.0 for x in metrics)
    kept = sorted(int(p.name[1:]) for p in (tmp_path / "lora").iterdir())
    assert kept == list(versions)[-ADAPTER_DIRS_KEPT:]
    # the field survives the control codec
    decoded = codec.decode_control(codec.encode_control(requests[0], "t"), "t")
    assert decoded.adapter_path == requests[0].adapter_path
