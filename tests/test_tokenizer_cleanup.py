"""transformers' `clean_up_tokenization_spaces`, as transformers 5.23 applies it when
decoding: real tokenizers (a byte-level BPE, a WordPiece, a Unigram) written to a
directory with a `tokenizer_config.json`, loaded by transformers' AutoTokenizer and by
custody's `load_tokenizer`, decode the same ids to the same text: cleaned up for the
WordPiece and the Unigram when the config asks, for the BPE only when the config also
sets the long BPE key. And a stream of such text, advanced token by token, joins to that
decode although the clean-up rewrites text that came before the token that triggers it."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.scheduler.text.detokenizer import Detokenizer
from shared.tokenizer import FileTokenizer, clean_up_tokenization, load_tokenizer

# Every rewrite of the clean-up has something to change here.
TEXTS = [
    "I do n't know . He 's here , are n't you ? I 'm sure ! We 've seen ' quoted ' words .",
    "you 're late , they 've gone ; is n't it ? ' ' ok ' . yes !",
    "a ' b ' ' c n't 's 'm 've 're . , ? ! end",
]
BPE_TOO = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"


def bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["[UNK]"], initial_alphabet=alphabet
    )
    tok.train_from_iterator(TEXTS * 4, trainer)
    return tok


def wordpiece() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(TEXTS * 4, trainers.WordPieceTrainer(special_tokens=["[UNK]"]))
    return tok


def unigram() -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=80, special_tokens=["<unk>"], unk_token="<unk>")
    tok.train_from_iterator(TEXTS * 4, trainer)
    return tok


def checkpoint(directory: Path, make: Callable[[], Tokenizer], config: dict | None) -> Path:
    directory.mkdir()
    make().save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


# (tokenizer, tokenizer_config.json or None for none, whether transformers cleans up)
CASES = {
    "bpe": (bpe, {"clean_up_tokenization_spaces": True}, False),
    "bpe-long-key": (bpe, {"clean_up_tokenization_spaces": True, BPE_TOO: True}, True),
    "bpe-long-key-false": (bpe, {"clean_up_tokenization_spaces": True, BPE_TOO: False}, False),
    "bpe-long-key-alone": (bpe, {BPE_TOO: True}, False),
    "wordpiece": (wordpiece, {"clean_up_tokenization_spaces": True}, True),
    "wordpiece-off": (wordpiece, {"clean_up_tokenization_spaces": False}, False),
    "wordpiece-no-config": (wordpiece, None, False),
    "unigram": (unigram, {"clean_up_tokenization_spaces": 1}, True),  # taken by truthiness
    "unigram-absent": (unigram, {}, False),
}


@pytest.fixture(scope="module", params=list(CASES))
def loaded(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[FileTokenizer, PreTrainedTokenizerBase, bool]:
    make, config, cleans = CASES[request.param]
    directory = checkpoint(tmp_path_factory.mktemp("tok") / request.param, make, config)
    ours = load_tokenizer(directory)
    assert isinstance(ours, FileTokenizer)
    return ours, AutoTokenizer.from_pretrained(str(directory)), cleans


def test_custody_decodes_as_transformers_does(loaded):
    ours, theirs, cleans = loaded
    assert ours.cleans_up is cleans
    rng, vocab = random.Random(3), ours._tok.get_vocab_size()
    for text in TEXTS:
        ids = ours.encode(text, False)
        assert theirs.encode(text, add_special_tokens=False) == ids
        plain = ours._tok.decode(ids, skip_special_tokens=True)
        # the clean-up rewrites this text (so the assertion below can tell it was applied)
        assert clean_up_tokenization(plain) != plain
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids) == (clean_up_tokenization(plain) if cleans else plain)
        for _ in range(50):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 24))]
            assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), ids


def test_the_clean_up_is_transformers_rewrite_for_rewrite(tmp_path: Path):
    """Against transformers' own function, on text dense in the patterns, where the order
    of the rewrites and their overlaps (" ' ' ") decide the result."""
    theirs = AutoTokenizer.from_pretrained(str(checkpoint(tmp_path / "wp", wordpiece, {})))
    rng = random.Random(5)
    for _ in range(3000):
        text = "".join(rng.choice(" ' ntmsvre.?!,x") for _ in range(rng.randint(0, 16)))
        assert clean_up_tokenization(text) == theirs.clean_up_tokenization(text), repr(text)


def test_a_stream_joins_to_the_cleaned_up_decode(loaded):
    """Token by token (and at random cuts): the clean-up deletes a space a later token
    turns out to precede (" ." after "know "), which a stream must not have sent."""
    ours, _, cleans = loaded
    rng, vocab = random.Random(11), ours._tok.get_vocab_size()
    cases = [ours.encode(text, False) for text in TEXTS]
    cases += [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(200)]
    for ids in cases:
        for every in (1, rng.randint(2, 5)):
            detok, out = Detokenizer(ours.decode, ours.cleans_up), []
            for n in range(every, len(ids), every):
                out.append(detok.advance(ids[:n]))
            out.append(detok.advance(ids, final=True))
            assert "".join(out) == ours.decode(ids), ids

    # Without holding back (a detokenizer not told the decode cleans up), some
    # token-by-token stream here sends a space the clean-up later deletes.
    def streamed(ids: list[int]) -> str:
        detok = Detokenizer(ours.decode, cleans_up=False)
        return "".join(detok.advance(ids[:n], final=n == len(ids)) for n in range(len(ids) + 1))

    assert any(streamed(ids) != ours.decode(ids) for ids in cases) is cleans
