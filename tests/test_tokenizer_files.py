"""The built-in model's tokenizer as files (`custody tokenizer export`): transformers'
AutoTokenizer, loading them as any `--tokenizer DIR` client does, encodes 1,000 generated
strings (any Unicode, special-token strings and near misses of them included) and decodes
1,000 id lists (invalid UTF-8 and special ids included) exactly as custody's byte
tokenizer does. What it cannot see: a client that decodes without skipping special
tokens (it then shows `<|eos|>` where custody shows nothing)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from custody.cli import main
from shared.tokenizer import BYTE_BOS, BYTE_EOS, BYTE_VOCAB, ByteTokenizer

PIECES = ["<|bos|>", "<|eos|>", "<|eos", "|>", "<|user|>\n", "<|bos|><|bos|>", " ", "\n"]


def generated_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 10)):
        kind = rng.random()
        if kind < 0.2:
            parts.append(rng.choice(PIECES))
        elif kind < 0.5:
            parts.append("".join(chr(rng.randint(32, 126)) for _ in range(rng.randint(1, 8))))
        else:
            code = rng.randint(0, 0x10FFFF)
            parts.append(chr(code if not 0xD800 <= code <= 0xDFFF else 0xFFFD))
    return "".join(parts)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("tokenizer")
    assert main(["tokenizer", "export", str(directory), "--context-len", "512"]) == 0
    return AutoTokenizer.from_pretrained(str(directory))


def test_the_exported_tokenizer_encodes_and_decodes_as_custody_does(exported):
    ours, rng = ByteTokenizer(), random.Random(7)
    for _ in range(1000):
        text = generated_text(rng)
        assert exported.encode(text) == ours.encode(text, True), repr(text)
        assert exported.encode(text, add_special_tokens=False) == ours.encode(text, False)
        ids = [rng.randrange(BYTE_VOCAB) for _ in range(rng.randint(0, 16))]
        assert exported.decode(ids, skip_special_tokens=True) == ours.decode(ids), ids


def test_the_exported_tokenizer_names_its_special_tokens_and_length(exported):
    assert (exported.bos_token_id, exported.eos_token_id) == (BYTE_BOS, BYTE_EOS)
    assert exported.model_max_length == 512
    chat = [{"role": "user", "content": "hi"}]
    text = exported.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>\nhi\n<|assistant|>\n"


def test_a_deployment_says_where_its_tokenizer_files_are(tmp_path: Path):
    from services.scheduler.text.tokenizer_files import tokenizer_files
    from shared.config import Settings

    written = tokenizer_files(Settings(), 256)
    assert (written / "tokenizer.json").exists() and (written / "tokenizer_config.json").exists()
    assert tokenizer_files(Settings(model=tmp_path), 256) is None  # no tokenizer.json: ids-only
    (tmp_path / "tokenizer.json").write_text("{}")
    assert tokenizer_files(Settings(model=tmp_path), 256) == tmp_path
