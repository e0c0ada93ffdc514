"""LoRA: low-rank adapters trained on a frozen base model (`model.lora.*`; docs/lora.md).

rank 0 (the default) trains every weight. rank > 0 freezes the base in model.dtype and trains
A [r, in] and B [out, r] beside each target linear layer, output += B(A(dropout(x))) * alpha / r.
How new weights reach the rollout servers (`ship`) and what `final_hf/` holds (`final_hf`) are
chosen here too; the engines and backends that cannot do a combination refuse it by name.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# the attention and MLP projections of Llama, Qwen2, Qwen3 and Mistral (their module names)
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraShip(enum.Enum):
    """What travels to the rollout servers after every step."""

    merged = "merged"  # base + B·A·scale, broadcast as full weights (every engine, every method)
    adapter = "adapter"  # the adapters alone (PEFT directory), loaded into the running servers


class LoraFinal(enum.Enum):
    """What RUN_DIR/final_hf/ holds."""

    merged = "merged"  # a plain Hugging Face model (the adapters merged in)
    adapter = "adapter"  # a PEFT adapter directory naming the base model (adapter_config.json)


@dataclass
class LoraConfig:
    """model.lora: 0 = full fine-tuning (default); > 0 = train adapters of this rank only."""

    rank: int = 0  # adapter rank; 0 = full fine-tuning
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # on the adapter's input in training (the proximal pass sees it too)
    # module-name suffixes of the nn.Linear layers that get adapters (PEFT's target_modules)
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    ship: LoraShip = LoraShip.merged
    final_hf: LoraFinal = LoraFinal.merged
    # ship=adapter: adapters one server holds at once: the current one, and older ones that
    # requests in flight still use (pause_mode=in_place keeps a request on its adapter)
    server_adapters: int = 4

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError("model.lora.rank must be >= 0 (0 = full fine-tuning)")
        if self.alpha <= 0:
            raise ValueError("model.lora.alpha must be > 0 (the adapters are scaled by alpha / rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError("model.lora.dropout must be in [0, 1)")
        if self.server_adapters < 1:
            raise ValueError("model.lora.server_adapters must be >= 1")
        if self.rank and not self.target_modules:
            raise ValueError(
                "model.lora.target_modules is empty: name the linear layers, e.g. [q_proj,v_proj]"
            )
        if not self.rank and (self.ship is not LoraShip.merged or self.final_hf is not LoraFinal.merged):
            raise ValueError(
                "model.lora.ship=adapter and model.lora.final_hf=adapter need adapters: set model.lora.rank > 0"
            )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def adapter_params(self, num_layers: int, projections: dict[str, tuple[int, int]]) -> int:
        """Trainable parameters: rank x (in + out) for every targeted projection of every decoder
        layer (`projections`: name -> (in, out) of one layer, e.g. from `decoder_projections`).
        Pure, for the memory model (launch/planning/fit/memory.py `trainable_params`)."""
        per_layer = sum(i + o for name, (i, o) in projections.items() if name in self.target_modules)
        return self.rank * per_layer * num_layers if self.enabled else 0


def decoder_projections(hidden: int, intermediate: int, num_heads: int, num_kv_heads: int,
                        head_dim: int) -> dict[str, tuple[int, int]]:  # fmt: skip
    """(in, out) of the linear layers of a Llama / Qwen2 / Qwen3 / Mistral decoder layer."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
        "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden),
    }  # fmt: skip
