"""A request's output as text: what stop strings are matched on, what a stream may show
so far, and the final text, all cut from one incremental detokenization (so streamed
text joined is the non-streamed text, always).

Who advances it, and when: the engine after every sampled token of a request with stop
strings (it must know at once whether one appeared), a streaming handler when it sends
a chunk, and the reply once at the end. A request that neither streams nor has stop
strings is decoded once, when it ends, outside the step loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.text.detokenizer import Detokenizer
from shared.tokenizer import Tokenizer


class OutputText:
    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...], trim: bool) -> None:
        self._detok = Detokenizer(tokenizer.decode, tokenizer.cleans_up)
        self.stops = stops
        self.trim = trim  # cut a matched stop string (and what follows) from the text
        self.stop_at: int | None = None  # where the matched stop string starts
        self._searched = 0  # characters of the text already searched for stop strings
        self._ended = False

    @property
    def tokens(self) -> int:
        """Output ids taken in so far."""
        return self._detok.read

    def advance(self, ids: Sequence[int]) -> None:
        if not self._ended:
            self._detok.advance(ids)

    def end(self, ids: Sequence[int]) -> None:
        """The output is complete: emit what was held back (an incomplete character)."""
        if not self._ended:
            self._detok.advance(ids, final=True)
            self._ended = True

    def find_stop(self, ids: Sequence[int]) -> str | None:
        """Advance, then the stop string that now appears first in the text, if any
        (only the new text and the characters before it a stop string could span are
        searched)."""
        self.advance(ids)
        text, longest = self._detok.text, max(map(len, self.stops), default=0)
        start = max(0, self._searched - longest + 1)
        self._searched = len(text)
        found = [(i, s) for s in self.stops if (i := text.find(s, start)) >= 0]
        if not found:
            return None
        self.stop_at, stop = min(found)
        return stop

    def final(self, ids: Sequence[int]) -> str:
        """The whole text of an ended request: cut before its stop string unless the
        request keeps it (no_stop_trim)."""
        self.end(ids)
        text = self._detok.text
        return text[: self.stop_at] if self.trim and self.stop_at is not None else text

    def shown(self, ids: Sequence[int], done: bool) -> str:
        """What a stream may show now: the final text once `done`; before, the text
        without a tail that could still become a trimmed stop string."""
        if done:
            return self.final(ids)
        self.advance(ids)
        text = self._detok.text
        if not self.trim or not self.stops:
            return text
        if self.stop_at is not None:
            return text[: self.stop_at]
        return text[: len(text) - _stop_start(text, self.stops)]


def _stop_start(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that some stop string starts with."""
    for n in range(min(len(text), max(map(len, stops)) - 1), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0
