"""Incremental detokenization alone (no services): for any ids, split anywhere, the
emitted pieces joined are the tokenizer's decode of all of them, for the byte tokenizer
and for a trained byte-level BPE full of multi-byte characters; and the stream view of
an output with stop strings only ever grows into the final text, which is cut before
the first stop string."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.text.detokenizer import Detokenizer
from services.scheduler.text.output import OutputText
from shared.tokenizer import BYTE_VOCAB, ByteTokenizer, FileTokenizer
from tests.checkpoints import train_tokenizer


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> FileTokenizer:
    path = Path(tmp_path_factory.mktemp("bpe")) / "tokenizer.json"
    train_tokenizer().save(str(path))
    return FileTokenizer(path)


def tokenizers(bpe: FileTokenizer) -> list[tuple[object, int]]:
    return [(ByteTokenizer(), BYTE_VOCAB), (bpe, bpe._tok.get_vocab_size())]


def pieces(tok, ids: list[int], cuts: list[int]) -> list[str]:
    """Advance at every cut (a stream's chunks), then end: the pieces emitted."""
    detok, out = Detokenizer(tok.decode), []
    for cut in sorted(c % (len(ids) + 1) for c in cuts):
        out.append(detok.advance(ids[:cut]))
    out.append(detok.advance(ids, final=True))
    assert "".join(out) == detok.text
    return out


IDS = st.lists(st.integers(0, 10**6), max_size=60)
CUTS = st.lists(st.integers(0, 10**6), max_size=20)


@settings(max_examples=150, deadline=None)
@given(raw=IDS, cuts=CUTS)
def test_joined_pieces_are_the_decode_of_all_ids(bpe, raw, cuts):
    for tok, vocab in tokenizers(bpe):
        ids = [i % vocab for i in raw]
        assert "".join(pieces(tok, ids, cuts)) == tok.decode(ids)


def test_a_split_character_is_held_back_not_replaced(bpe):
    """What the old per-token stream decode did wrong: each token decoded alone turns a
    character split across tokens into U+FFFD halves."""
    tok = ByteTokenizer()
    ids = tok.encode("日本語 ✓", False)
    naive = "".join(tok.decode([i]) for i in ids)
    assert naive != tok.decode(ids) and "\ufffd" in naive
    per_token = pieces(tok, ids, list(range(len(ids))))
    assert "".join(per_token) == "日本語 ✓" and "\ufffd" not in "".join(per_token)
    ids = bpe.encode("Grüße 日本語のテキスト 🙂🚀", False)
    assert "".join(pieces(bpe, ids, list(range(len(ids))))) == bpe.decode(ids)


TEXTS = st.text(alphabet="ab日🙂 ", max_size=30)


@settings(max_examples=150, deadline=None)
@given(text=TEXTS, stops=st.lists(st.text(alphabet="ab日🙂 ", min_size=1, max_size=3), max_size=3))
def test_the_stream_view_grows_into_the_final_text_cut_at_the_first_stop(text, stops):
    """As the engine drives it: a stop check after every token, a stream view at each."""
    tok = ByteTokenizer()
    ids, out = tok.encode(text, False), OutputText(tok, tuple(stops), trim=True)
    views, matched, fed = [], None, []
    for token in ids:
        fed.append(token)
        matched = out.find_stop(fed) if stops else None
        views.append(out.shown(fed, matched is not None))
        if matched is not None:
            break
    final = out.final(fed)
    full = tok.decode(fed)
    for a, b in itertools.pairwise([*views, final]):
        assert b.startswith(a)
    if matched is None:
        assert final == full and not any(s in full for s in stops)
    else:
        assert matched in full and final == full[: min(full.find(s) for s in stops if s in full)]
