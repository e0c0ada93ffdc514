"""weight_sync.sync=delta into a real SGLang server (the session's CPU server), through SGLang's
custom weight loader: after a full copy, several deltas and a refused one (wrong base version,
answered with the whole bucket), the server's live weights are bitwise those of a full copy of the
same version (SGLang's own per-parameter checksums, /weights_checker), its greedy tokens are the
same and its log-probs within rounding.

The trainer's float32 masters travel rounded to bfloat16 (rollout.dtype=bfloat16), so the deltas
are what a bf16 server gets: about 1% of the values per step. Runs last of the session server's
modules (file name) and leaves it on the initial weights at version 8.
"""

from __future__ import annotations

import asyncio

import pytest
import requests
import torch
from float_ulps import ulps_from
from safetensors.torch import load_file
from sglang_harness import EncodedBroadcaster, client_for

from areal_jobs.api import GenerateRequest
from areal_jobs.config import DType
from tests.integration.engine_parity import prompts

pytestmark = pytest.mark.sglang


def checksums(server) -> dict[str, str]:
    """SGLang's own checksum of every live parameter (its fused layout: qkv_proj, gate_up_proj)."""
    r = requests.post(
        f"{server.url}/weights_checker",
        json={"action": "checksum"},
        headers={"Authorization": f"Bearer {server.api_key}"},
        timeout=120,
    )
    r.raise_for_status()
    ranks = r.json()["ranks"]
    assert len(ranks) == 1
    return ranks[0]["checksums"]


def step(named: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """An RL-sized step on the float32 masters: small moves, so ~1% of the bf16 values change."""
    for t in named.values():
        t.add_(torch.randn(t.shape, generator=gen) * t.abs().mean() * 1e-4)


async def greedy(server, inputs) -> list[tuple[list[int], list[float]]]:
    client = client_for(server)
    try:
        out = await asyncio.gather(
            *(client.generate(GenerateRequest(f"d{i}", ids, 16, 0.0)) for i, ids in enumerate(inputs))
        )
    finally:
        await client.close()
    return [(r.output_ids, r.logprobs) for r in out]


def assert_same_server(a, b, max_ulps: float = 8.0) -> None:
    """Every live parameter bit for bit, the same greedy tokens, and log-probs within a few float32
    ulps: with bitwise-equal weights, SGLang's CPU kernels still round differently when the three
    concurrent requests batch differently (CI: 1 ulp at -4.53), so only the weights are bitwise."""
    (sums_a, greedy_a), (sums_b, greedy_b) = a, b
    assert sums_a == sums_b
    assert [t for t, _ in greedy_a] == [t for t, _ in greedy_b]
    lp_a = torch.tensor([x for _, lp in greedy_a for x in lp], dtype=torch.float32)
    lp_b = torch.tensor([x for _, lp in greedy_b for x in lp], dtype=torch.float32)
    error = ulps_from(lp_a, lp_b)
    assert float(error.max()) <= max_ulps, f"log-probs {float(error.max()):.1f} ulps apart (bound {max_ulps})"


def test_deltas_leave_the_server_bitwise_equal_to_a_full_copy(sglang_server, tiny_model_dir):
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    masters = {n: t.clone() for n, t in original.items()}
    inputs = prompts(tiny_model_dir, 3)
    gen = torch.Generator().manual_seed(3)

    async def go():
        caster = EncodedBroadcaster(sglang_server, masters, dtype=DType.bfloat16)
        try:
            await caster.publish(1)  # the anchor: a full copy
            for version in (2, 3):
                step(masters, gen)
                await caster.publish(version)
            saved = {n: t.clone() for n, t in caster.stage.copy.tensors.items()}
            step(masters, gen)
            await caster.publish(4)
            after_deltas = checksums(sglang_server), await greedy(sglang_server, inputs)
            await caster.publish(5, servers_version=-1)  # the same weights as a full copy
            after_full = checksums(sglang_server), await greedy(sglang_server, inputs)
            # the sender cuts version 6 from version 3 while the server holds 5 (as if the
            # controller were wrong): refused, answered with the whole bucket, never applied
            step(masters, gen)
            for name, t in saved.items():
                caster.stage.copy.tensors[name].copy_(t)
            caster.stage.copy.version = 3
            await caster.publish(6, servers_version=3)
            after_refusal = checksums(sglang_server), await greedy(sglang_server, inputs)
            await caster.publish(7, servers_version=-1)
            after_full_again = checksums(sglang_server), await greedy(sglang_server, inputs)
            for name, t in original.items():
                masters[name].copy_(t)
            await caster.publish(8, servers_version=-1)  # as the session's other tests found it
            return caster.phases, (after_deltas, after_full), (after_refusal, after_full_again)
        finally:
            await caster.close()

    phases, deltas, refusal = asyncio.run(go())
    assert [p.delta for p in phases] == [False, True, True, True, False, True, False, False]
    assert [p.refused_buckets > 0 for p in phases] == [False] * 5 + [True, False, False]
    for p in phases[1:4]:  # a delta carries a small share of the bytes of a full copy
        assert 0 < p.changed < 0.1 * p.elements and p.bytes_per_server < 0.25 * p.full_bytes
        assert p.server_apply_s > 0 and p.server_load_s > 0  # the loader reported its own phases
    assert_same_server(*deltas)
    assert_same_server(*refusal)
    assert deltas[1][0] != refusal[1][0]  # the step between them changed parameters: a real comparison
