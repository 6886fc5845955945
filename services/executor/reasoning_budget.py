"""A reply that thinks before its constrained answer (shared/messages/grammar.py
`ReasoningPrefix`): the grammar that lets the reasoning run free up to its end marker,
and the budget that ends it.

Why the marker is watched here and not left to the grammar alone: xgrammar can hold the
answer back until the reasoning closes, but it cannot count tokens, and a model that
never closes its reasoning (a small or random one, or one that rambles) would then never
reach its answer. So the executor counts the row's output tokens; from the budget on,
while the block is still open, it forces the marker's tokens one per step. The state is
a function of the output alone, so a matcher rebuilt from a replay (an executor
restart, a re-prefill) forces exactly what the first one would have.
"""

from __future__ import annotations

import json

import xgrammar as xgr

from shared.messages.grammar import ReasoningPrefix


def reasoning_grammar(close: str) -> xgr.Grammar:
    """Any text up to and including the first `close` (what the reasoning may be)."""
    tag = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": close}
    return xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": tag}))


class ReasoningBudget:
    """Where one row's reasoning stands: open or closed, and how many tokens it took."""

    def __init__(self, prefix: ReasoningPrefix, token_bytes: list[bytes]) -> None:
        self.prefix = prefix
        self.close = prefix.close.encode()
        self.token_bytes = token_bytes
        self.taken = 0  # output tokens so far
        self.open = True
        self.tail = b""  # the last bytes of the reasoning, shorter than the marker

    def forced(self) -> int | None:
        """The token the next output must be (the marker's next one, once the budget is
        spent with the block open); None: the grammar alone decides."""
        past = self.taken - self.prefix.budget
        if not self.open or past < 0 or past >= len(self.prefix.close_ids):
            return None
        return self.prefix.close_ids[past]

    def take(self, token: int) -> None:
        """The row's next output token (sampled or forced)."""
        self.taken += 1
        if not self.open:
            return
        text = self.tail + (self.token_bytes[token] if token < len(self.token_bytes) else b"")
        if self.close in text:
            self.open, self.tail = False, b""
        else:
            self.tail = text[-(len(self.close) - 1) :] if len(self.close) > 1 else b""
