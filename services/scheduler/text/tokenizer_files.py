"""The built-in model's byte tokenizer as Hugging Face tokenizer files, so that any client
taking `--tokenizer DIR` (SGLang's bench_serving, lm-eval, AIPerf, transformers'
`AutoTokenizer`) tokenizes exactly as custody does (shared/tokenizer.py).

`tokenizer.json` is a byte-level BPE with no merges: every byte is its own token, with
the byte's value as its id, and `<|bos|>` (256) and `<|eos|>` (257) are special tokens.
Byte-level BPE spells bytes as printable characters (the printable ASCII and Latin-1
bytes as themselves, the 68 others as the characters from U+0100 on, in byte order), so
the vocabulary is written in that alphabet. `tokenizer_config.json` names the special
tokens, the context length and the built-in chat template.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from services.scheduler.text.chat_template import DEFAULT_TEMPLATE
from shared.config import Settings
from shared.tokenizer import BYTE_BOS, BYTE_EOS, BYTE_SPECIALS


def byte_alphabet() -> list[str]:
    """The character byte-level BPE writes for each byte value 0..255."""
    printable = set(range(ord("!"), ord("~") + 1))
    printable |= set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    shown, others = [], 0
    for byte in range(256):
        if byte in printable:
            shown.append(chr(byte))
        else:
            shown.append(chr(256 + others))
            others += 1
    return shown


def tokenizer_json() -> dict:
    vocab = {char: byte for byte, char in enumerate(byte_alphabet())}
    specials = [
        {
            "id": token_id,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for text, token_id in BYTE_SPECIALS.items()
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": specials,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab | {text: i for text, i in BYTE_SPECIALS.items()},
            "merges": [],
        },
    }


def tokenizer_config(context_len: int) -> dict:
    names = {i: text for text, i in BYTE_SPECIALS.items()}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": names[BYTE_BOS],
        "eos_token": names[BYTE_EOS],
        "model_max_length": context_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": DEFAULT_TEMPLATE,
    }


def export_byte_tokenizer(directory: Path, context_len: int) -> Path:
    """Write both files into `directory` (created if needed), each replaced whole, so a
    reader never sees half a file; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": tokenizer_config(context_len),
    }
    for name, content in files.items():
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(content, out, ensure_ascii=False, indent=1)
        os.replace(tmp, directory / name)
    return directory


def tokenizer_files(settings: Settings, context_len: int) -> Path | None:
    """Where a client finds this deployment's tokenizer files: the checkpoint's directory
    when it has a `tokenizer.json` (and `--tokenizer` is not `byte`), the byte
    tokenizer's files written under the system's temporary directory when it runs the
    byte tokenizer, else None (ids-only)."""
    model = settings.model
    if model is not None and settings.tokenizer != "byte":
        return Path(model) if (Path(model) / "tokenizer.json").exists() else None
    place = Path(tempfile.gettempdir()) / f"custody-byte-tokenizer-{context_len}"
    return export_byte_tokenizer(place, context_len)
