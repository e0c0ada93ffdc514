"""A pretrained checkpoint the project did not build (SmolLM2-135M-Instruct: Llama architecture, tied
embeddings, ChatML template), end to end against one real SGLang server, torch and Megatron trainers.

The tests share the module's server and run in file order; each says the weights it leaves there.
No small Qwen2-family checkpoint ships in a package on the index (only a 7B DeepSeek-R1-Distill-Qwen
GGUF, split in parts), so the Qwen2 path keeps the tiny random Qwen2 of tests/integration/megatron.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import torch

from areal_jobs.api import BucketSpec, GenerateRequest, TensorSpec, WeightSender
from areal_jobs.atomic import write_atomic
from areal_jobs.config import AlgoConfig, DataConfig, Dataset, DType, TrainerConfig
from areal_jobs.data.prompts import load_prompts
from areal_jobs.data.tokenizer import load_tokenizer
from areal_jobs.trainer.forward.hf_logprobs import token_logprobs
from areal_jobs.trainer.intake.batch import TrainBatch, TrainSample
from areal_jobs.trainer.torch.backend import TorchBackend
from tests.integration.sglang.sglang_harness import Broadcaster, client_for

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
GSM8K = REPO / "tests" / "fixtures" / "gsm8k" / "test_head50.jsonl"
LOGPROB_TOL = (1e-3, 1e-2)  # (mean, max) |server - trainer|, fp32: the tolerance of tests/integration/sglang


def chat_prompts(model_dir: Path, n: int) -> list[list[int]]:
    """The first n GSM8K rows as training sees them (data.chat_template=auto)."""
    data = DataConfig(dataset=Dataset.gsm8k, train_path=str(GSM8K), num_eval_prompts=n)
    return [
        p.input_ids for p in load_prompts(data, str(model_dir), load_tokenizer(model_dir).encode).held_out
    ]


def post(server, body: dict) -> dict:
    headers = {"Authorization": f"Bearer {server.api_key}"}
    r = requests.post(f"{server.url}/generate", json=body, headers=headers, timeout=600)
    r.raise_for_status()
    return r.json()


def server_scores(server, samples: list[TrainSample]) -> np.ndarray:
    """The server's log-probs of each sample's output tokens, teacher-forced (prefill only)."""
    out = []
    for s in samples:
        meta = post(
            server,
            {"input_ids": s.input_ids.tolist(), "return_logprob": True, "logprob_start_len": 0,
             "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}},
        )["meta_info"]  # fmt: skip
        rows = meta["input_token_logprobs"]
        assert [int(r[1]) for r in rows] == s.input_ids.tolist()
        out.append([float(r[0]) for r in rows[s.num_prompt_tokens :]])
    return np.concatenate(out)


def sample_batch(server, model_dir: Path, n_prompts: int, group: int, max_new: int) -> TrainBatch:
    """Groups sampled by the server at version 0, with synthetic +-1 advantages (a toy reward)."""
    stop = load_tokenizer(model_dir).stop_token_ids
    inputs = chat_prompts(model_dir, n_prompts)

    async def go():
        client = client_for(server)
        try:
            reqs = [
                GenerateRequest(f"b{i}-{j}-{time.monotonic_ns()}", ids, max_new, 1.0, stop_token_ids=stop)
                for i, ids in enumerate(inputs)
                for j in range(group)
            ]
            return await asyncio.gather(*(client.generate(r) for r in reqs))
        finally:
            await client.close()

    responses = asyncio.run(go())
    samples = []
    for k, r in enumerate(responses):
        prompt = inputs[k // group]
        samples.append(
            TrainSample(
                f"g{k // group}s{k % group}",
                np.array(prompt + r.output_ids, dtype=np.int64),
                len(prompt),
                np.array(r.logprobs, dtype=np.float32),
                np.zeros(len(r.output_ids), dtype=np.int32),
                1.0 if k % group < group // 2 else -1.0,
                0.0,
            )  # fmt: skip
        )
    return TrainBatch(version=0, samples=samples, group_ids=[f"g{i}" for i in range(n_prompts)])


def trainer(model_dir: Path, lr: float = 1e-5) -> TorchBackend:
    backend = TorchBackend(TrainerConfig(lr=lr), AlgoConfig(), str(model_dir), DType.float32)
    backend.setup()
    return backend


def trainer_scores(backend: TorchBackend, samples: list[TrainSample]) -> np.ndarray:
    backend.model.eval()
    with torch.no_grad():
        return torch.cat(token_logprobs(backend.model, samples)).numpy()


def test_chat_template_reaches_the_server_verbatim(pretrained_server, pretrained_dir, record_property):
    """Leaves the server on the pretrained weights."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(pretrained_dir))
    row = json.loads(GSM8K.read_text().splitlines()[0])
    data = DataConfig(dataset=Dataset.gsm8k, train_path=str(GSM8K), num_eval_prompts=1)
    prompts = load_prompts(data, str(pretrained_dir), load_tokenizer(pretrained_dir).encode)
    user = prompts.format.user_text(row)
    expected = hf.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    first = prompts.stream.rows[0]  # the training file's first row, rendered
    ids = load_tokenizer(pretrained_dir).encode(first.text)
    assert first.text == hf.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
    )
    assert ids == expected and ids[0] == hf.convert_tokens_to_ids("<|im_start|>")
    meta = post(
        pretrained_server,
        {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
         "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}},
    )["meta_info"]  # fmt: skip
    assert [int(r[1]) for r in meta["input_token_logprobs"]] == expected  # what the server computed on
    record_property("prompt_tokens", len(ids))


def test_server_logprobs_match_the_torch_trainer(pretrained_server, pretrained_dir, record_property):
    """Leaves the server on the pretrained weights."""
    batch = sample_batch(pretrained_server, pretrained_dir, n_prompts=4, group=1, max_new=32)
    served = np.concatenate([s.behav_logprobs for s in batch.samples])
    diff = np.abs(trainer_scores(trainer(pretrained_dir), batch.samples) - served)
    record_property("logprob_max_abs_diff", float(diff.max()))
    print(f"\n[pretrained torch] |server - trainer| log-prob over {diff.size} tokens: "
          f"max {diff.max():.2e}, mean {diff.mean():.2e}")  # fmt: skip
    assert diff.size > 50
    assert diff.mean() < LOGPROB_TOL[0] and diff.max() < LOGPROB_TOL[1]


def test_one_rl_step_and_broadcast_move_the_server_as_the_trainer(
    pretrained_server, pretrained_dir, tmp_path, record_property
):
    """Leaves the server on the torch trainer's weights after one step (version 1); the saved
    final_hf/ reloads in transformers with identical logits."""
    from transformers import AutoModelForCausalLM

    batch = sample_batch(pretrained_server, pretrained_dir, n_prompts=2, group=4, max_new=24)
    backend = trainer(pretrained_dir)
    trainer_before = trainer_scores(backend, batch.samples)
    server_before = server_scores(pretrained_server, batch.samples)
    metrics = backend.train_step(batch)
    trainer_after = trainer_scores(backend, batch.samples)

    async def publish():
        caster = Broadcaster(pretrained_server, bucket_bytes=32 << 20)
        try:
            await caster.publish(dict(backend.iter_weights()), version=1)
        finally:
            await caster.close()

    asyncio.run(publish())
    server_after = server_scores(pretrained_server, batch.samples)
    moved_trainer, moved_server = trainer_after - trainer_before, server_after - server_before
    gap = np.abs(moved_server - moved_trainer)
    print(f"\n[pretrained torch step] trainer moved mean |dlogp| {np.abs(moved_trainer).mean():.3e}; "
          f"server - trainer change: max {gap.max():.2e}, mean {gap.mean():.2e}; loss {metrics.get('train/loss')}")  # fmt: skip
    record_property("update_gap_max", float(gap.max()))
    assert np.abs(moved_trainer).mean() > 1e-3  # the step changed the policy
    assert gap.mean() < 0.1 * np.abs(moved_trainer).mean() and gap.max() < LOGPROB_TOL[1]
    # positive-advantage samples got likelier on both sides
    pos = np.concatenate([np.full(s.num_output_tokens, s.advantage > 0) for s in batch.samples])
    assert moved_trainer[pos].sum() > 0 and moved_server[pos].sum() > 0

    final = tmp_path / "final_hf"
    backend.save_hf(str(final))
    reloaded = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    assert reloaded.config.tie_word_embeddings and (final / "chat_template.jinja").exists()
    backend.model.eval()
    worst = 0.0
    with torch.no_grad():
        for s in batch.samples:
            ids = torch.as_tensor(s.input_ids)[None]
            worst = max(worst, float((reloaded(ids).logits - backend.model(ids).logits).abs().max()))
    print(f"[pretrained torch final_hf] max |logit diff| after reload: {worst:.1e}")
    record_property("final_hf_logit_gap", worst)
    assert worst == 0.0


# ---------------------------------------------------------------------------------------- Megatron


def megatron_worker(rank: int, world: int, model_dir: str, batch: TrainBatch, exchange: str) -> dict:
    """One Megatron rank: logits vs transformers before the step, one step, broadcast, final_hf."""
    from areal_jobs.weights.broadcast import WeightBroadcastGroup
    from areal_jobs.weights.buckets import plan_buckets
    from tests.integration.megatron.harness import start_backend, trainer_config

    backend = start_backend(model_dir, trainer_config(lr=1e-5, max_tokens_per_microbatch=512))
    seqs = [s.input_ids for s in batch.samples]
    before = backend.full_logits(seqs).float()
    metrics = backend.train_step(batch)
    after = backend.full_logits(seqs).float()
    buckets = plan_buckets(backend.weight_specs(), 32 << 20)
    # port 0, bound before publishing: a port picked free earlier can be taken meanwhile
    group = WeightBroadcastGroup("megatron-pretrained", "127.0.0.1", 0, "gloo", timeout_s=300.0)
    plan = [[[t.name, t.dtype, list(t.shape)] for t in b.tensors] for b in buckets]
    write_atomic(
        Path(exchange, "plan.json"),
        json.dumps({"group": group.base_name, "port": group.listen(), "buckets": plan}),
    )
    group.init(world_size=2, generation=0)
    weights = dict(backend.iter_weights())
    for b in buckets:
        group.send_bucket(b, [weights[t.name] for t in b.tensors], f"bucket {b.index}")
    group.destroy()
    backend.save_hf(str(Path(exchange) / "final_hf"))
    return {"before": before.numpy(), "after": after.numpy(), "loss": metrics.get("train/loss")}


@pytest.mark.megatron
def test_megatron_step_broadcast_and_final_hf_on_the_pretrained_checkpoint(
    pretrained_server, pretrained_dir, tmp_path, record_property
):
    """Leaves the server on the Megatron trainer's weights after one step from the pretrained ones."""
    from transformers import AutoModelForCausalLM

    from areal_jobs.config import PauseMode
    from areal_jobs.rollout.server_pool import ServerPool
    from areal_jobs.rollout.weight_update import WeightUpdateOrchestrator
    from tests.integration.megatron.harness import run_ranks

    pytest.importorskip("megatron.core")
    batch = sample_batch(pretrained_server, pretrained_dir, n_prompts=2, group=2, max_new=16)
    hf = AutoModelForCausalLM.from_pretrained(str(pretrained_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        hf_before = torch.cat([hf(torch.as_tensor(s.input_ids)[None]).logits[0] for s in batch.samples])
    exchange = tmp_path / "exchange"
    exchange.mkdir()

    async def receive(plan: dict) -> None:
        buckets = tuple(
            BucketSpec(i, tuple(TensorSpec(n, d, tuple(s)) for n, d, s in tensors))
            for i, tensors in enumerate(plan["buckets"])
        )
        senders = (WeightSender(plan["group"], "127.0.0.1", plan["port"], buckets),)
        pool = ServerPool()
        pool.add(0, client_for(pretrained_server))
        updater = WeightUpdateOrchestrator(pool, PauseMode.abort, step_timeout_s=300)
        try:
            await updater.pause(lambda: 0)
            await updater.init_groups(senders, "gloo")
            await updater.receive(2, senders)
            await updater.resume()
        finally:
            await pool.slots[0].client.close()

    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(
            run_ranks, megatron_worker, 1, str(pretrained_dir), batch, str(exchange), timeout_s=900
        )
        deadline = time.monotonic() + 900
        while not (exchange / "plan.json").exists():
            assert time.monotonic() < deadline and not job.done(), (
                job.exception() if job.done() else "timeout"
            )
            time.sleep(1.0)
        asyncio.run(receive(json.loads((exchange / "plan.json").read_text())))
        (result,) = job.result(timeout=900)

    load_gap = float(np.abs(result["before"] - hf_before.numpy()).max())
    after = torch.as_tensor(result["after"])
    offsets = np.cumsum([0] + [len(s.input_ids) for s in batch.samples])
    megatron_lp = np.concatenate([
        torch.log_softmax(after[o : o + len(s.input_ids)].double(), -1)[
            torch.arange(s.num_prompt_tokens - 1, len(s.input_ids) - 1), torch.as_tensor(s.input_ids[s.num_prompt_tokens :])
        ].numpy()
        for o, s in zip(offsets, batch.samples)
    ])  # fmt: skip
    served = server_scores(pretrained_server, batch.samples)
    sync_gap = np.abs(served - megatron_lp)
    from tests.integration.megatron.harness import hf_state

    saved = hf_state(exchange / "final_hf")
    assert "lm_head.weight" not in saved and sorted(saved) == sorted(hf_state(pretrained_dir))  # still tied
    assert (exchange / "final_hf" / "chat_template.jinja").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(str(exchange / "final_hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        reload_logits = torch.cat(
            [reloaded(torch.as_tensor(s.input_ids)[None]).logits[0] for s in batch.samples]
        )
    reload_gap = float((reload_logits - after).abs().max())
    moved = float(np.abs(result["after"] - result["before"]).mean())
    print(f"\n[pretrained megatron] logits vs transformers at load: max {load_gap:.2e}; step moved logits "
          f"mean {moved:.2e}; server vs Megatron log-probs after broadcast: max {sync_gap.max():.2e}, "
          f"mean {sync_gap.mean():.2e}; final_hf reload logit gap max {reload_gap:.2e}")  # fmt: skip
    record_property("megatron_load_logit_gap", load_gap)
    record_property("megatron_sync_logprob_gap", float(sync_gap.max()))
    record_property("megatron_final_hf_logit_gap", reload_gap)
    assert load_gap < 1e-3
    assert moved > 1e-4
    assert sync_gap.mean() < LOGPROB_TOL[0] and sync_gap.max() < LOGPROB_TOL[1]
    assert reload_gap < 1e-3


# -------------------------------------------------------------------------------------------- LoRA


def test_one_lora_rl_step_and_broadcast_match_the_server(pretrained_server, pretrained_dir, record_property):
    """model.lora.rank=8 on the pretrained checkpoint: one RL step trains the adapters only, the
    merged policy (base + B·A·scale, model.lora.ship=merged: SGLang on CPU loads no adapters) is
    broadcast, and the server's log-probs after it match the trainer's LoRA model as tightly as
    with full weights. Leaves the server on that merged policy (version 3)."""
    from areal_jobs.config import LoraConfig
    from areal_jobs.trainer.forward import lora
    from areal_jobs.weights.buckets import tensor_bytes

    batch = sample_batch(pretrained_server, pretrained_dir, n_prompts=2, group=4, max_new=24)
    backend = TorchBackend(
        TrainerConfig(lr=1e-3),
        AlgoConfig(),
        str(pretrained_dir),
        DType.float32,
        LoraConfig(rank=8, alpha=16.0),
    )
    backend.setup()
    base = {k: v.clone() for k, v in backend.model.state_dict().items() if not lora.is_adapter_key(k)}
    trainer_before = trainer_scores(backend, batch.samples)
    metrics = backend.train_step(batch)
    trainer_after = trainer_scores(backend, batch.samples)
    assert all(torch.equal(v, base[k]) for k, v in backend.model.state_dict().items() if k in base)

    async def publish():
        caster = Broadcaster(pretrained_server, bucket_bytes=32 << 20)
        try:
            await caster.publish(dict(backend.iter_weights()), version=3)
        finally:
            await caster.close()

    asyncio.run(publish())
    server_after = server_scores(pretrained_server, batch.samples)
    moved = np.abs(trainer_after - trainer_before).mean()
    gap = np.abs(server_after - trainer_after)
    full_bytes = sum(tensor_bytes(s) for s in backend.weight_specs())
    adapter_bytes = sum(
        t.numel() * t.element_size() for t in lora.adapter_state(backend.model.state_dict()).values()
    )
    print(f"\n[pretrained LoRA r=8 step] trainer moved mean |dlogp| {moved:.3e}; server vs trainer after "
          f"the broadcast: max {gap.max():.2e}, mean {gap.mean():.2e} over {gap.size} tokens; loss "
          f"{metrics['train/loss']:.4f}; trainable {metrics['memory/trainable_param_bytes'] / 1e6:.2f} MB of "
          f"{metrics['memory/param_bytes'] / 1e6:.1f} MB, AdamW state {metrics['memory/optimizer_state_bytes'] / 1e6:.2f} MB; "
          f"per update: adapters {adapter_bytes / 1e6:.2f} MB vs merged {full_bytes / 1e6:.1f} MB")  # fmt: skip
    record_property("lora_update_gap_max", float(gap.max()))
    record_property("lora_moved", float(moved))
    assert moved > 1e-3  # the adapters' step changed the policy
    assert gap.mean() < LOGPROB_TOL[0] and gap.max() < LOGPROB_TOL[1]
    pos = np.concatenate([np.full(s.num_output_tokens, s.advantage > 0) for s in batch.samples])
    assert (trainer_after - trainer_before)[pos].sum() > 0 and (server_after - trainer_before)[pos].sum() > 0
    assert metrics["memory/trainable_param_bytes"] < 0.02 * metrics["memory/param_bytes"]
