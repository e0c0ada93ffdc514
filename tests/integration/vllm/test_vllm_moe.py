"""vLLM CPU serving a mixture of experts (a tiny random Qwen3-MoE, 4 experts, top-2): its log-probs
match the trainer's before and after a broadcast update of every weight, the experts included.

The update case failed before vllm_worker._repack_moe_experts: vLLM 0.32 copies reloaded expert
weights into its CPU kernel's prepacked parameters without packing them (8.8 nats per token off).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from vllm_harness import start_vllm

from areal_jobs.tasks.warm_start.tiny_model import PACKAGED_DIR
from tests.integration.engine_parity import assert_parity, prompts, server_trainer_gap, trainer
from tests.integration.vllm.test_vllm_rollout import generate_all, perturbed, publish

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(PACKAGED_DIR))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = Qwen3MoeConfig(
            vocab_size=len(tokenizer), hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
            num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True,
            bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        model = Qwen3MoeForCausalLM(config)
        with torch.no_grad():  # decisive routing: no near-tie between the 2nd and 3rd expert
            # (head_dim 32: vLLM CPU attention has no kernel for 16)
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp("tiny-moe")
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def moe_server(moe_dir, tmp_path_factory):
    server = start_vllm(moe_dir, tmp_path_factory.mktemp("vllm-moe") / "server.log")
    yield server
    server.stop()


def test_moe_logprobs_match_the_trainer_before_and_after_an_update(moe_server, moe_dir, record_property):
    inputs = prompts(moe_dir, 8)
    before = server_trainer_gap(
        trainer(moe_dir).model, inputs, asyncio.run(generate_all(moe_server, inputs, 48, 1.0))
    )
    backend = perturbed(moe_dir, seed=1)  # every tensor moves, the experts' and routers' included
    asyncio.run(publish(moe_server, dict(backend.iter_weights()), 1))
    responses = asyncio.run(generate_all(moe_server, inputs, 48, 1.0, tag="v1-"))
    assert all(r.weight_version == 1 for r in responses)
    after = server_trainer_gap(backend.model, inputs, responses)
    for name, gap in (("before", before), ("after", after)):
        record_property(f"{name}_logprob_max_abs_diff", float(gap.max()))
        print(
            f"\n{name} update: |server - trainer| over {gap.size} tokens: max {gap.max():.2e}, mean {gap.mean():.2e}"
        )
        assert_parity(gap)


def test_moe_deltas_carry_the_experts_and_equal_a_full_copy(moe_server, moe_dir, tmp_path):
    """weight_sync.sync=delta on the MoE: a full copy, then two sparse deltas (2% of each tensor's
    values, the experts' and routers' included) give greedy answers equal to a full copy of the
    same weights, and sampled log-probs that match the trainer holding those weights. The expert kernel's re-pack
    runs after a delta as after a full copy (vllm_worker.areal_end_update)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from vllm_harness import client_for

    from areal_jobs.config import DType
    from tests.integration.sglang.sglang_harness import EncodedBroadcaster

    original = load_file(str(moe_dir / "model.safetensors"))
    assert any(".experts.3." in name for name in original), sorted(original)[:8]  # per-expert names
    masters = {n: t.clone() for n, t in original.items()}
    inputs = prompts(moe_dir, 8)
    gen = torch.Generator().manual_seed(5)

    def step():  # 2% of every tensor's values move far: sparse deltas that still change answers
        for t in masters.values():
            picked = torch.rand(t.shape, generator=gen) < 0.02
            t.add_(picked * torch.randn(t.shape, generator=gen) * t.abs().mean())

    async def greedy():
        out = await generate_all(moe_server, inputs[:3], 16, 0.0, tag="moe-delta")
        return [(r.output_ids, r.logprobs) for r in out]

    async def go():
        caster = EncodedBroadcaster(moe_server, masters, client=client_for(moe_server), dtype=DType.bfloat16)
        try:
            await caster.publish(11)  # the anchor: a full copy of the original weights
            before = await greedy()
            for version in (12, 13):
                step()
                await caster.publish(version)
            after_deltas = await greedy()
            sampled = await generate_all(moe_server, inputs, 48, 1.0, tag="moe-delta-t1")
            served = {n: t.to(torch.float32).clone() for n, t in caster.stage.copy.tensors.items()}
            await caster.publish(14, servers_version=-1)  # the same weights as a full copy
            after_full = await greedy()
            return caster.phases, before, after_deltas, after_full, sampled, served
        finally:
            await caster.close()

    phases, before, after_deltas, after_full, sampled, served = asyncio.run(go())
    assert [p.delta for p in phases] == [False, True, True, False]
    for p in phases[1:3]:
        assert 0 < p.changed < 0.1 * p.elements and p.bytes_per_server < 0.5 * p.full_bytes
    assert after_deltas == after_full  # greedy tokens and log-probs, exactly
    assert after_deltas != before  # the deltas moved the answers: a real comparison
    assert all(r.weight_version == 13 for r in sampled)
    held = tmp_path / "served"  # the weights the server holds (bf16 on the wire), for the trainer
    shutil.copytree(moe_dir, held)
    save_file({n: t.contiguous() for n, t in served.items()}, str(held / "model.safetensors"))
    gap = server_trainer_gap(trainer(held).model, inputs, sampled)
    print(
        f"\nafter 2 deltas: |server - trainer| over {gap.size} tokens: max {gap.max():.2e}, mean {gap.mean():.2e}"
    )
    assert_parity(gap)
