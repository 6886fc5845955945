"""Text <-> token ids. The built-in model is byte-level (ids 0-255 are bytes, then BOS
and EOS, written `<|bos|>` and `<|eos|>`); a checkpoint with a `tokenizer.json` uses it
through the `tokenizers` package. A checkpoint without one runs ids-only: token ids work,
text is refused naming the file (its vocabulary is not bytes, so guessing would feed the
model nonsense); `--tokenizer byte` opts in to the byte tokenizer anyway. No torch here:
the scheduler tokenizes."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

BYTE_VOCAB, BYTE_BOS, BYTE_EOS = 258, 256, 257
BYTE_SPECIALS = {"<|bos|>": BYTE_BOS, "<|eos|>": BYTE_EOS}
_BYTE_SPECIAL = re.compile("(" + "|".join(map(re.escape, BYTE_SPECIALS)) + ")")
TOKENIZER_KINDS = ("auto", "byte")


class TokenizerMissing(ValueError):
    """Text was given to a deployment that runs ids-only (a 400 at the edge)."""


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """`add_special_tokens`: what the tokenizer's post-processor adds (a BOS) for a
        raw text that starts a sequence; False for a rendered chat template (it emits
        its own) and for a session turn after the first."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Special tokens skipped; an incomplete UTF-8 sequence ends in U+FFFD."""
        ...

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The strings `encode` turns into special tokens (none for bytes)."""
        ...

    @property
    def cleans_up(self) -> bool:
        """Whether `decode` applies transformers' clean-up of spaces, which deletes a
        space once later text shows what it precedes (a stream must hold it back)."""
        ...

    def encode_plain(self, text: str) -> list[int]:
        """`text` with special-token strings in it encoded as plain text (chat message
        content, docs/chat.md); no special tokens added."""
        ...


class ByteTokenizer:
    """UTF-8 bytes. The two special tokens' strings in raw text are those tokens, as a
    Hugging Face tokenizer matches its own (so the files `export_byte_tokenizer` writes
    encode exactly as this does, and a client that learns the EOS id by encoding its
    string, as lm-eval does, gets it); it has no post-processor, so it adds none."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(_BYTE_SPECIAL.split(text)):
            if i % 2:
                ids.append(BYTE_SPECIALS[piece])
            else:
                ids += piece.encode("utf-8")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    special_tokens: tuple[str, ...] = tuple(BYTE_SPECIALS)
    cleans_up = False

    def encode_plain(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


# The clean-up's rewrites, applied in this order, each to the text the one before left:
# each pattern loses its spaces (" ' " both, the others the leading one).
_CLEAN_UPS = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")
_BPE_TOO = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"


def clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`, rewrite for rewrite (a decoded text must be
    the same text transformers decodes)."""
    for pattern in _CLEAN_UPS:
        text = text.replace(pattern, pattern.strip(" "))
    return text


class FileTokenizer:
    """A `tokenizer.json` (Hugging Face `tokenizers` format), as transformers uses it."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(path))
        config_path = path.parent / "tokenizer_config.json"
        config = json.loads(config_path.read_text("utf-8")) if config_path.exists() else {}
        # As transformers 5.23 decodes: the clean-up when the config asks for it, except
        # for a BPE model, whose real spaces before punctuation it would delete, unless
        # the config insists (values taken by truthiness, as transformers does).
        self.cleans_up = bool(config.get("clean_up_tokenization_spaces")) and (
            type(self._tok.model).__name__ != "BPE" or bool(config.get(_BPE_TOO))
        )

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=True)
        return clean_up_tokenization(text) if self.cleans_up else text

    @property
    def special_tokens(self) -> tuple[str, ...]:
        added = self._tok.get_added_tokens_decoder().values()
        return tuple(t.content for t in added if t.special)

    def encode_plain(self, text: str) -> list[int]:
        self._tok.encode_special_tokens = True
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = False


class NoTokenizer:
    """Ids-only: encoding refuses, naming the missing file; output text is empty."""

    def __init__(self, missing: Path) -> None:
        self.missing = missing

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        raise TokenizerMissing(
            f"this model runs ids-only: {self.missing} is missing, so text and chat "
            "input are refused; send input_ids (or start with --tokenizer byte)"
        )

    def decode(self, ids: Sequence[int]) -> str:
        return ""

    special_tokens: tuple[str, ...] = ()
    cleans_up = False

    def encode_plain(self, text: str) -> list[int]:
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(model_dir: Path | None, kind: str = "auto") -> Tokenizer:
    """The byte tokenizer for the built-in model or when asked (`kind` "byte"), else the
    checkpoint's `tokenizer.json`, else ids-only."""
    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"tokenizer must be one of {TOKENIZER_KINDS}, got {kind!r}")
    if model_dir is None or kind == "byte":
        return ByteTokenizer()
    path = Path(model_dir) / "tokenizer.json"
    return FileTokenizer(path) if path.exists() else NoTokenizer(path)
