"""Text <-> token ids for the controller, from a model directory's tokenizer.json.

Uses the `tokenizers` library directly: the controller needs encode/decode only, and must not pay
for importing transformers. Special tokens (EOS) are dropped when decoding for the reward.
"""

from __future__ import annotations

import json
from pathlib import Path

# end-of-turn tokens of common chat formats (ChatML, Llama 3, Gemma, Phi): a generation stops at
# any of them that the tokenizer has as a special token
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


class TextTokenizer:
    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        file = Path(path) / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(
                f"{file} not found: model.path must be a Hugging Face directory with tokenizer.json"
            )
        self._tok = Tokenizer.from_file(str(file))
        self.stop_token_ids = end_token_ids(Path(path), self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def decode_raw(self, ids: list[int]) -> str:
        """With special tokens (chat markup, end tokens): what the model saw, for sample dumps."""
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()


def end_token_ids(model_dir: Path, tok) -> tuple[int, ...]:
    """Where generation ends: the tokenizer's eos token, generation_config.json's eos_token_id
    (an id or a list), and the chat end-of-turn tokens the tokenizer has as special tokens."""
    ids: list[int] = []

    def add(token_id) -> None:
        if isinstance(token_id, int) and token_id >= 0 and token_id not in ids:
            ids.append(token_id)

    config = model_dir / "tokenizer_config.json"
    if config.exists():
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            add(tok.token_to_id(eos))
    generation = model_dir / "generation_config.json"
    if generation.exists():
        eos_ids = json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id")
        for token_id in eos_ids if isinstance(eos_ids, list) else [eos_ids]:
            add(token_id)
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    for token in END_OF_TURN:
        if token in specials:
            add(tok.token_to_id(token))
    return tuple(ids)


def load_tokenizer(path: str | Path) -> TextTokenizer:
    return TextTokenizer(path)
