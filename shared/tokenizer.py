"""Text <-> token ids. The built-in model is byte-level (ids 0-255 are bytes, then BOS
and EOS); a checkpoint with a `tokenizer.json` uses it through the `tokenizers` package.
No torch here: the scheduler tokenizes."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

BYTE_VOCAB, BYTE_BOS, BYTE_EOS = 258, 256, 257


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class FileTokenizer:
    """A `tokenizer.json` (Hugging Face `tokenizers` format)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir: Path | None) -> Tokenizer:
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").exists():
        return FileTokenizer(Path(model_dir) / "tokenizer.json")
    return ByteTokenizer()
