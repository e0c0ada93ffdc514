"""Adapter shipping (model.lora.ship=adapter): what a server needs at launch, and which adapter a
request names.

Every update loads the trainer's PEFT directory into each running server under a fresh name
(`areal-v<version>-<n>`); requests sent from then on name it, so every token a request samples
comes from that one adapter and its version is exactly the adapter's, whatever happens while it
runs (pause_mode=in_place keeps a paused request on the adapter it started with; abort re-sends it
under the newest one, as with full weights). Both engines key their prefix caches by adapter, so
no request reuses KV of another version. Older adapters are unloaded as soon as no request of
ours uses them (SGLang's unload waits for the adapter's requests, and would hold its LoRA lock
meanwhile: only idle adapters are unloaded).

Launch: SGLang `--enable-lora --max-lora-rank --lora-target-modules --max-loras-per-batch`; vLLM
`--enable-lora --max-lora-rank --max-loras --max-cpu-loras` and VLLM_ALLOW_RUNTIME_LORA_UPDATING
(its /v1/load_lora_adapter route; our middleware guards it like every other route). SGLang's
LoRA layers pin host memory and use CUDA streams unconditionally (`pin_memory=True requires a
CUDA or other accelerator backend`, measured with sglang 0.5.23 on CPU, every --lora-backend):
SGLang on CPU refuses adapter shipping; ship=merged works there.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from areal_jobs.config import LoraConfig, LoraShip, RolloutEngine

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted --max-lora-rank values


def check_adapter_shipping(engine: RolloutEngine, lora: LoraConfig, cpu: bool) -> None:
    """Raise ValueError naming the override when this engine cannot load adapters here."""
    if lora.ship is LoraShip.adapter and engine is RolloutEngine.sglang and cpu:
        raise ValueError(
            "model.lora.ship=adapter is not supported by SGLang on CPU (its LoRA layers pin host "
            "memory and use CUDA streams): set model.lora.ship=merged, or rollout/engine=vllm"
        )


def lora_server_args(engine: RolloutEngine, lora: LoraConfig, cpu: bool) -> list[str]:
    """Extra server flags for adapter shipping (none for ship=merged: the servers see a plain model)."""
    if lora.ship is not LoraShip.adapter:
        return []
    check_adapter_shipping(engine, lora, cpu)
    if engine is RolloutEngine.vllm:
        rank = next((r for r in VLLM_RANKS if r >= lora.rank), None)
        if rank is None:
            raise ValueError(f"model.lora.rank={lora.rank} is above vLLM's largest ({VLLM_RANKS[-1]})")
        slots = str(lora.server_adapters)
        return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", slots, "--max-cpu-loras", slots]
    return [
        "--enable-lora",
        "--max-lora-rank", str(lora.rank),
        "--lora-target-modules", *sorted(lora.target_modules),
        # adapters in one batch, the base-only slot included
        "--max-loras-per-batch", str(lora.server_adapters + 1),
    ]  # fmt: skip


def lora_server_env(engine: RolloutEngine, lora: LoraConfig) -> dict[str, str]:
    if lora.ship is LoraShip.adapter and engine is RolloutEngine.vllm:
        return {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # the /v1/(un)load_lora_adapter routes
    return {}


@dataclass
class AdapterSet:
    """One server's adapters as its client sees them: the current one, and the loaded ones with
    the number of our requests in flight on each."""

    current: tuple[str, int] | None = None  # (name, version): what requests sent now name
    loaded: dict[str, int] = field(default_factory=dict)  # name -> version
    in_flight: Counter = field(default_factory=Counter)
    loads: int = 0

    def new_name(self, version: int) -> str:
        """A name never used on this server (a version published again gets a new one)."""
        self.loads += 1
        return f"areal-v{version}-{self.loads}"

    def loaded_as(self, name: str, version: int) -> None:
        self.loaded[name] = version
        self.current = (name, version)

    def acquire(self) -> tuple[str, int] | None:
        """The adapter a request sent now names (None: the base weights), counted in flight."""
        if self.current is not None:
            self.in_flight[self.current[0]] += 1
        return self.current

    def release(self, adapter: tuple[str, int] | None) -> None:
        if adapter is not None:
            self.in_flight[adapter[0]] -= 1
            if self.in_flight[adapter[0]] <= 0:
                del self.in_flight[adapter[0]]

    def idle(self) -> list[str]:
        """Loaded adapters that are not current and that no request of ours uses."""
        current = self.current[0] if self.current else None
        return [n for n in self.loaded if n != current and not self.in_flight.get(n)]

    def unloaded(self, name: str) -> None:
        self.loaded.pop(name, None)
