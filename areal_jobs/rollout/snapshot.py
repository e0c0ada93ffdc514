"""The controller's half of a checkpoint: everything needed to resume rollout exactly.

    controller.json   version, prompt-stream position, staleness counters, re-queued prompts,
                      counters, and every group in progress with each sample's episode so far
                      (agent/episode.py: tokens, loss mask, behaviour log-probs, policy versions,
                      the recorded turns and tool calls, and the reward of finished episodes); a
                      resumed episode replays its recording and continues the turn in progress
    groups.bin        trajectory groups pushed to the trainer but not trained by this step,
                      in the wire codec's frames (length-prefixed), re-sent on resume

Together with the trainer's checkpoint of the same step this is a consistent cut: every prompt
of the stream before `stream_position` is trained, in a saved group, or in a saved partial group.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from areal_jobs.agent.episode import EpisodeState
from areal_jobs.atomic import write_atomic
from areal_jobs.transport import codec, routes
from areal_jobs.transport import messages as m

_DISK_TOKEN = "checkpoint"  # groups on disk are not on the wire; the codec still checks a token
SNAPSHOT_VERSION = 2  # 2: samples are episodes (EpisodeState); their `routes` default to [] when absent

PartialSample = EpisodeState  # the name of a sample in progress before episodes (issue 15)


@dataclass
class PartialGroup:
    data_index: int
    attempt: int
    samples: list[EpisodeState]


@dataclass
class ControllerSnapshot:
    step: int
    version: int
    stream_position: int
    staleness: dict[str, int]
    requeued: list[tuple[int, int]]
    counters: dict[str, int]
    partial: list[PartialGroup]
    retained: list[m.TrajectoryGroup] = field(default_factory=list)
    # algo.max_staleness=auto: the bound law's state (areal_jobs/staleness_bound.py); {} otherwise, and
    # in snapshots written before it (the law then starts again at the ceiling)
    bound_law: dict = field(default_factory=dict)
    drift_version: int = -1  # the last version whose DriftReport the law took

    @property
    def num_partial_samples(self) -> int:
        return sum(len(g.samples) for g in self.partial)


def to_trajectory(s: EpisodeState, num_prompt_tokens: int = 0) -> m.SampleTrajectory:
    """A finished episode as the trainer receives it (its expert routes, if any, over its
    `num_prompt_tokens` prompt and its output positions)."""
    return m.SampleTrajectory(
        sample_id=s.sample_id,
        output_ids=np.asarray(s.output_ids, dtype=np.int32),
        logprobs=np.asarray(s.logprobs, dtype=np.float32),
        versions=np.asarray(s.versions, dtype=np.int32),
        reward=s.reward,
        reward_status=s.reward_status,
        finish_reason=s.finish_reason,
        num_interruptions=s.interruptions,
        # None (all ones) for a plain answer: the wire and the trainer see what they always did
        loss_mask=None if all(s.loss_mask) else np.asarray(s.loss_mask, dtype=np.uint8),
        num_turns=s.num_turns,
        num_tool_calls=s.num_tool_calls,
        routes=routes.assemble(s.routes, num_prompt_tokens + len(s.output_ids)),
    )


def save_snapshot(snap: ControllerSnapshot, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in asdict(snap).items() if k != "retained"}
    meta["snapshot_version"] = SNAPSHOT_VERSION
    write_atomic(folder / "controller.json", json.dumps(meta), durable=True)
    chunks = []
    for group in snap.retained:
        frames = codec.encode_group(group, _DISK_TOKEN)
        chunks.append(struct.pack("<I", len(frames)))
        for frame in frames:
            chunks += [struct.pack("<Q", len(frame)), frame]
    write_atomic(folder / "groups.bin", b"".join(chunks), durable=True)


def load_snapshot(folder: Path) -> ControllerSnapshot:
    meta = json.loads((folder / "controller.json").read_text())
    if meta.pop("snapshot_version", None) != SNAPSHOT_VERSION:
        raise ValueError(f"{folder}/controller.json was written by another areal_jobs version")
    partial = [
        PartialGroup(g["data_index"], g["attempt"], [EpisodeState(**s) for s in g["samples"]])
        for g in meta.pop("partial")
    ]
    requeued = [tuple(x) for x in meta.pop("requeued")]
    data = (folder / "groups.bin").read_bytes()
    retained, offset = [], 0
    while offset < len(data):
        (count,), offset = struct.unpack_from("<I", data, offset), offset + 4
        frames = []
        for _ in range(count):
            (size,), offset = struct.unpack_from("<Q", data, offset), offset + 8
            frames.append(data[offset : offset + size])
            offset += size
        retained.append(codec.decode_group(frames, _DISK_TOKEN))
    return ControllerSnapshot(partial=partial, requeued=requeued, retained=retained, **meta)
