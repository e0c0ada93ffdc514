"""The trainer_memory bench's check for full-size tensors goes by shape, not by size."""

from bench.trainer.trainer_memory_bench import full_size_tensors

V = 151936


def tensor(*shape: int, dtype: str = "float32") -> dict:
    return {"shape": list(shape), "dtype": dtype, "bytes": 4}


def test_a_head_chunk_is_not_tokens_by_vocab():
    # 2,048 tokens = 2 sequences of 64 + 960: 1,920 scored rows; a chunk holds 1,024 of them
    assert full_size_tensors([tensor(1024, V), tensor(1024, 1, V), tensor(V, 1024)], 2048, V) == (
        False,
        False,
    )


def test_every_scored_row_by_the_vocabulary_is():
    assert full_size_tensors([tensor(2048, V)], 2048, V) == (True, False)
    assert full_size_tensors([tensor(1, 1920, V)], 2048, V) == (True, False)
    assert full_size_tensors([tensor(1920, V, dtype="bfloat16")], 2048, V) == (False, False)


def test_a_token_by_token_mask_is():
    assert full_size_tensors([tensor(1, 1, 2048, 2048)], 2048, V) == (False, True)
    assert full_size_tensors([tensor(2048, 64)], 2048, V) == (False, False)
