"""The delta codec (weights/delta.py) and a receiver's copy (weights/receiver.BaseCopy): exact
round trips, the compact index encoding, and every refusal leaving the copy untouched."""

from __future__ import annotations

import pytest
import torch

from areal_jobs.weights import delta as codec
from areal_jobs.weights.receiver import BaseCopy


def _perturbed(base: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    """`base` with about `share` of its elements moved by one ulp or more (bits differ)."""
    gen = torch.Generator().manual_seed(seed)
    new = base.clone()
    mask = torch.rand(base.shape, generator=gen) < share
    new[mask] = (base[mask].float() * 1.01 + 0.01).to(base.dtype)
    return new


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(codec.bits(a), codec.bits(b)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_a_sparse_change_round_trips_bit_exactly(dtype):
    base = [torch.randn(300, 700).to(dtype), torch.randn(5000).to(dtype)]
    new = [_perturbed(t, 0.01, i) for i, t in enumerate(base)]
    header, payload, entries = codec.encode_bucket(base, new, base_version=4, version=5)
    assert [e.kind for e in entries] == [codec.SPARSE, codec.SPARSE]
    target = [t.clone() for t in base]
    touched = codec.apply_bucket(target, header, payload)
    assert touched == [0, 1] and all(_bits_equal(t, n) for t, n in zip(target, new))
    # 2 bytes of gap + the element per position (anchors included), each part padded to 8 bytes
    itemsize = base[0].element_size()
    assert payload.numel() == sum(codec.entry_bytes(codec.SPARSE, e.count, itemsize) for e in entries)
    changed = codec.changed_elements(entries)
    assert payload.numel() <= (2 + itemsize) * changed + 32 + (2 + itemsize) * (210000 // codec.GAP_LIMIT + 2)


def test_gaps_past_the_uint16_range_are_bridged_by_anchors():
    base = torch.zeros(3 * codec.GAP_LIMIT + 123, dtype=torch.bfloat16)
    new = base.clone()
    new[0] = 1.0
    new[-1] = 2.0  # ~200k elements after the first change: no gap fits uint16 without anchors
    header, payload, entries = codec.encode_bucket([base], [new], 0, 1)
    assert entries[0].kind == codec.SPARSE and entries[0].changed == 2 and entries[0].count == 5
    target = [base.clone()]
    codec.apply_bucket(target, header, payload)
    assert _bits_equal(target[0], new)


def test_an_unchanged_tensor_costs_nothing_and_a_dense_change_goes_whole():
    same = torch.randn(64, 64)
    moved = torch.randn(64, 64)
    header, payload, entries = codec.encode_bucket([same, moved], [same.clone(), moved + 1e-3], 0, 1)
    assert [e.kind for e in entries] == [codec.SAME, codec.DENSE]
    assert payload.numel() == 64 * 64 * 4
    target = [same.clone(), moved.clone()]
    assert codec.apply_bucket(target, header, payload) == [1]
    assert torch.equal(target[1], moved + 1e-3)


def test_a_full_copy_needs_no_base_and_carries_every_byte():
    new = [torch.randn(10, 3).to(torch.bfloat16), torch.randn(7)]
    header, payload, _ = codec.encode_bucket(None, new, base_version=9, version=10)
    assert header.base_version == -1 and header.kinds == (codec.DENSE, codec.DENSE)
    target = [torch.empty(10, 3, dtype=torch.bfloat16), torch.empty(7)]
    codec.apply_bucket(target, header, payload)
    assert all(_bits_equal(t, n) for t, n in zip(target, new))


def test_the_header_survives_its_tensor_form():
    header, _, _ = codec.encode_bucket([torch.zeros(4)], [torch.ones(4)], 3, 4)
    again = codec.Header.from_tensor(header.to_tensor(), 1)
    assert again == header
    with pytest.raises(ValueError, match="2 tensors"):
        codec.Header.from_tensor(header.to_tensor(), 2)


def test_a_checksum_mismatch_is_refused_and_undone():
    base = [torch.randn(1000).to(torch.bfloat16), torch.randn(50)]
    new = [_perturbed(base[0], 0.02, 1), base[1] + 1.0]
    header, payload, _ = codec.encode_bucket(base, new, 0, 1)
    held = [t.clone() for t in base]
    untouched = int((codec.bits(new[0]) == codec.bits(base[0])).nonzero()[0])
    held[0][untouched] += 1.0  # not the sender's base where the delta writes nothing: wrong result
    before = [t.clone() for t in held]
    with pytest.raises(codec.DeltaRefused) as refused:
        codec.apply_bucket(held, header, payload)
    assert refused.value.reason == codec.CHECKSUM
    assert all(_bits_equal(h, b) for h, b in zip(held, before))  # never applied


def test_a_malformed_payload_is_refused_and_undone():
    base = [torch.randn(1000).to(torch.bfloat16)]
    header, payload, _ = codec.encode_bucket(base, [_perturbed(base[0], 0.02, 2)], 0, 1)
    held = [base[0].clone()]
    with pytest.raises(codec.DeltaRefused) as refused:
        codec.apply_bucket(held, header, payload[:-8])
    assert refused.value.reason == codec.MALFORMED and _bits_equal(held[0], base[0])
    bad = payload.clone()
    bad[:2] = 255  # the first gap points past the tensor's end
    wrong = codec.Header(
        header.base_version, 1, header.crc, header.payload_bytes, header.kinds, header.counts
    )
    with pytest.raises(codec.DeltaRefused):
        codec.apply_bucket(held, wrong, torch.cat([bad]))
    assert _bits_equal(held[0], base[0])


def test_the_receivers_copy_refuses_a_delta_it_cannot_take():
    copy = BaseCopy()
    spec = [("w", torch.bfloat16, (4, 4))]
    with pytest.raises(codec.DeltaRefused) as refused:
        copy.targets(spec, base_version=3)
    assert refused.value.reason == codec.NO_BASE
    held = copy.fresh(spec)
    held[0].zero_()
    copy.mark(["w"], 3)
    assert copy.targets(spec, 3)[0] is held[0]
    with pytest.raises(codec.DeltaRefused) as refused:
        copy.targets(spec, 2)
    assert refused.value.reason == codec.WRONG_BASE
    with pytest.raises(codec.DeltaRefused) as refused:
        copy.targets([("w", torch.bfloat16, (2, 8))], 3)
    assert refused.value.reason == codec.SHAPE
    with pytest.raises(codec.DeltaRefused) as refused:
        copy.targets([("w", torch.float32, (4, 4))], 3)
    assert refused.value.reason == codec.SHAPE
