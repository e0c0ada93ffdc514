"""The weight update's phases (docs/weight-sync.md) as a model: seconds per update from the model's
size, the links and the rates of each phase, for a full copy or a delta. Pure.

Phases run one after the other, as areal_jobs/weights/sender.py runs them (no overlap between
buckets):

    full   fixed + gather + stage (cast, flatten) + wire + load
    delta  fixed + gather + stage + [host: device-to-host + diff + crc] + wire (changed elements)
           + server [host: crc + host-to-device] + load

`copy: host` is this implementation: the sender's last shipped copy and every server's copy
live in host memory, so each delta costs passes over the whole model there (diff, crc on both
sides) and a reload of every changed tensor from it. `copy: device` is the target design (the
copies in GPU memory, the diff and the crc at HBM speed, the delta applied in place into the
engine's own parameters): what verl's delta_sharded and checkpoint-engine approach. The wire
term is a pipelined broadcast: every link carries the bytes once whatever the number of servers.
Every anchor version (`full_every`) is a full copy.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass
class WeightUpdateModel:
    """Seconds of one update; `params_b: 0` keeps the profile's constant trainer.weight_sync_s."""

    params_b: float = 0.0  # parameters, billions
    wire_bytes_per_param: float = 2.0  # bfloat16 on the wire (rollout.dtype)
    link_gbit_per_s: float = 400.0  # one NIC of the sender
    link_efficiency: float = 0.8  # achieved share of the line rate (NCCL broadcast bus bandwidth)
    senders: int = 1  # pipeline stages: each sends its share over its own NIC at the same time
    gather_gb_per_s: float = 100.0  # TP/FSDP gather of the full tensors onto the sender (NVLink)
    stage_gb_per_s: float = 400.0  # cast + flatten on the sender's GPU (HBM)
    load_gb_per_s: float = 400.0  # the engine copying a received bucket into its weights (HBM)
    fixed_s: float = 0.3  # pause, resume, per-bucket calls
    mode: str = "full"  # full | delta
    copy: str = "host"  # delta: host (this implementation) | device (the target)
    changed_fraction: float = 0.01  # bf16 values that change per step (PULSE, verl: 1-3 %)
    delta_bytes_per_changed: float = 4.0  # uint16 gap + bf16 value (weights/delta.py)
    full_every: int = 20  # weight_sync.full_every
    pcie_gb_per_s: float = 25.0  # copy: host, device <-> pinned host per GPU
    host_scan_gb_per_s: float = 4.0  # copy: host, diff or checksum over host bytes, one core (zlib here)
    host_threads: int = 16  # copy: host, cores the scans are spread over (weights/delta.crc_of)
    host_memory_gb_per_s: float = 50.0  # copy: host, what streaming scans get from host memory at most
    device_scan_gb_per_s: float = 1000.0  # copy: device, diff / checksum / in-place apply on a GPU

    def check(self) -> None:
        if self.mode not in ("full", "delta") or self.copy not in ("host", "device"):
            raise ValueError("weights.mode must be full|delta and weights.copy host|device")
        if self.params_b < 0 or self.full_every < 1 or self.senders < 1 or self.host_threads < 1:
            raise ValueError(
                "weights.params_b must be >= 0, weights.full_every, weights.senders and weights.host_threads >= 1"
            )
        if not 0.0 <= self.changed_fraction <= 1.0 or not 0.0 < self.link_efficiency <= 1.0:
            raise ValueError("weights.changed_fraction must be in [0, 1], weights.link_efficiency in (0, 1]")

    @property
    def enabled(self) -> bool:
        return self.params_b > 0

    @property
    def full_bytes(self) -> float:
        return self.params_b * 1e9 * self.wire_bytes_per_param

    @property
    def delta_bytes(self) -> float:
        return self.params_b * 1e9 * self.changed_fraction * self.delta_bytes_per_changed

    def _wire_s(self, nbytes: float) -> float:
        return nbytes / self.senders / (self.link_gbit_per_s / 8 * GB * self.link_efficiency)

    def phases(self, delta: bool) -> dict[str, float]:
        """Seconds per phase of one update (a full copy when `delta` is False)."""
        b = self.full_bytes
        out = {
            "fixed": self.fixed_s,
            "gather": b / self.senders / (self.gather_gb_per_s * GB),
            "stage": b / self.senders / (self.stage_gb_per_s * GB),
            "wire": self._wire_s(self.delta_bytes if delta else b),
            "load": b / (self.load_gb_per_s * GB),
        }
        if not delta:
            return out
        if self.copy == "host":
            per_sender = b / self.senders
            scan = min(self.host_scan_gb_per_s * self.host_threads, self.host_memory_gb_per_s) * GB
            # sender: the new copy to the host, the diff, the checksum; server: the checksum of its
            # copy, then every changed tensor back into GPU memory
            out["stage"] += per_sender / (self.pcie_gb_per_s * GB) + 2 * per_sender / scan
            out["load"] += b / scan + b / (self.pcie_gb_per_s * GB)
        else:  # diff and crc on the sender's GPU; applied in place: nothing reloaded
            out["stage"] += 2 * b / self.senders / (self.device_scan_gb_per_s * GB)
            out["load"] = b / (self.device_scan_gb_per_s * GB)
        return out

    def update_s(self, version: int) -> float:
        delta = self.mode == "delta" and version % self.full_every != 0
        return sum(self.phases(delta).values())

    def mean_update_s(self) -> float:
        """Over one anchor cycle: full_every - 1 deltas and one full copy (delta mode)."""
        return sum(self.update_s(v) for v in range(1, self.full_every + 1)) / self.full_every
