"""Where one weight update's seconds and bytes went, on the sender and as its receivers report it.

One `UpdatePhases` per update of one sender (a pipeline stage): the trainer logs it as `weights/*`
metrics beside the controller's view (the pause generation sees, the servers' calls). Phases:

    gather   the backend's export of the full tensors (TP gathers on Megatron)
    stage    cast to the serving dtype, host copy, flatten; delta: diff against the last shipped
             copy, encode, crc
    send     every bucket on the wire (delta: header, payload, status exchange, any whole-bucket
             answer); the slowest bucket too
    server   encoded buckets only: what the receivers measured themselves (receive, apply onto
             their copy and verify, load into the engine), the slowest rank of each bucket summed
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class UpdatePhases:
    delta: bool = False  # this update carried a delta (False: a full copy)
    base_version: int = -1  # the version the delta was cut from
    gather_s: float = 0.0
    stage_s: float = 0.0
    send_s: float = 0.0
    bucket_send_max_s: float = 0.0
    bytes_per_server: float = 0.0  # what every server rank received (a broadcast: the same for all)
    full_bytes: float = 0.0  # what a full copy of the same tensors is
    elements: int = 0
    changed: int = 0  # elements whose bits changed since the last shipped copy (delta mode)
    sparse_tensors: int = 0
    dense_tensors: int = 0
    same_tensors: int = 0
    refused_buckets: int = 0  # a receiver refused the delta and took the whole bucket instead
    server_recv_s: float = 0.0
    server_apply_s: float = 0.0
    server_load_s: float = 0.0
    encoded: bool = False  # the buckets went through our receiver (weight_sync.sync=delta)

    def add_bucket_send(self, seconds: float) -> None:
        self.send_s += seconds
        self.bucket_send_max_s = max(self.bucket_send_max_s, seconds)

    def add_server_rows(self, rows: list[list[int]]) -> None:
        """Receivers' status rows of one bucket (microseconds); the sender's own row is rank 0's."""
        others = rows[1:]
        if not others:
            return
        self.server_recv_s += max(r[2] for r in others) / 1e6
        self.server_apply_s += max(r[3] for r in others) / 1e6
        self.server_load_s += max(r[4] for r in others) / 1e6

    def metrics(self) -> dict[str, float]:
        out = {
            "weights/gather_s": self.gather_s,
            "weights/stage_s": self.stage_s,
            "weights/send_s": self.send_s,
            "weights/bucket_send_max_s": self.bucket_send_max_s,
            "weights/bytes_per_server": self.bytes_per_server,
            "weights/full_bytes": self.full_bytes,
            "weights/delta": float(self.delta),
        }
        if self.encoded:
            out.update(
                {
                    "weights/changed_fraction": self.changed / max(self.elements, 1),
                    "weights/bytes_ratio": self.bytes_per_server / max(self.full_bytes, 1.0),
                    "weights/sparse_tensors": float(self.sparse_tensors),
                    "weights/dense_tensors": float(self.dense_tensors),
                    "weights/same_tensors": float(self.same_tensors),
                    "weights/refused_buckets": float(self.refused_buckets),
                    "weights/server_recv_s": self.server_recv_s,
                    "weights/server_apply_s": self.server_apply_s,
                    "weights/server_load_s": self.server_load_s,
                }
            )
        return out
