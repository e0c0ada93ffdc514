"""Text <-> token ids for the controller, from a model directory's tokenizer.json.

Uses the `tokenizers` library directly: the controller needs encode/decode only, and must not pay
for importing transformers. Special tokens (EOS) are dropped when decoding for the reward.
"""

from __future__ import annotations

from pathlib import Path


class TextTokenizer:
    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        file = Path(path) / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(
                f"{file} not found: model.path must be a Hugging Face directory with tokenizer.json"
            )
        self._tok = Tokenizer.from_file(str(file))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()


def load_tokenizer(path: str | Path) -> TextTokenizer:
    return TextTokenizer(path)
