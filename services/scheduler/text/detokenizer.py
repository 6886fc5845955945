"""Incremental detokenization, as vLLM and SGLang do it.

Decoding one token at a time breaks text: a multi-byte UTF-8 character split across
tokens decodes to U+FFFD halves, and a tokenizer whose decoder strips a leading space
(SentencePiece's "▁") loses it when a token is decoded without the one before. So the
text of new ids is always decoded in a window that starts at the previous chunk's ids
(`prefix`, kept as context), and only what extends the context's own text is emitted;
while the window's text ends in U+FFFD (an incomplete character, or a pending byte) it
is held back until the ids that complete it arrive, or the output ends.

Each advance decodes the window only (the ids since the last emitted chunk and that
chunk's ids), never the whole output, so streaming a reply costs O(new tokens) per
advance. `text` is the one source every reply's text is cut from.

A tokenizer that applies transformers' clean-up (its `cleans_up`, shared/tokenizer.py)
deletes a space once later text shows
what it precedes: "know " then "." is "know.", and a stream that sent the space cannot
take it back. So a chunk is also held while the clean-up of text yet to come could
still change its end, and the chunks joined are the clean-up of the whole text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class Detokenizer:
    """The text of a growing list of ids (a request's output), advanced lazily."""

    def __init__(self, decode: Callable[[Sequence[int]], str], cleans_up: bool = False) -> None:
        self._decode = decode
        self._cleans_up = cleans_up  # `decode` applies transformers' clean-up
        self.text = ""  # the complete text of ids[:read]
        self._prefix = 0  # start of the context window: the last emitted chunk's ids
        self._read = 0  # ids whose text is in `text`

    @property
    def read(self) -> int:
        return self._read

    def advance(self, ids: Sequence[int], final: bool = False) -> str:
        """Take in `ids[read:]` (the list only ever grows) and return the text that is
        now complete (`final`: the output ended, emit whatever is held)."""
        if len(ids) == self._read:
            return ""
        context = self._decode(ids[self._prefix : self._read])
        window = self._decode(ids[self._prefix :])
        held = window.endswith(REPLACEMENT) or len(window) <= len(context)
        held = held or (self._cleans_up and not _settled(window))
        if held and not final:
            return ""  # an incomplete character, or nothing new yet (a skipped special)
        delta = window[len(context) :]
        self.text += delta
        self._prefix, self._read = self._read, len(ids)
        return delta


def _settled(text: str) -> bool:
    """Whether the clean-up (shared/tokenizer.py) of any text that follows `text` leaves
    `text` as it is. It deletes only a space, and only one before . ? ! , or n't, or
    beside a ', so `text` is settled if its last four characters hold no space or ' (the
    raw text then ends in four characters the clean-up does not touch), or if it ends in
    a word with no ' that is not "n" (no rewrite starts with a space, then that word)."""
    word = text.rsplit(" ", 1)[-1]
    return "'" not in word[-4:] and not (word in ("", "n") and " " in text)
