"""Constrained decoding on the wire: what a request's output must match (`GrammarSpec`),
the matcher state a constrained row samples from (`RowGrammar`), and the compile check
the scheduler asks of the executor before it admits a request (`GrammarCheck`).

The executor owns the matchers (services/executor/grammars.py): it samples every token,
so the mask of a row always comes from its real last token and no mask crosses the
wire. The scheduler owns the output, so it is the one that can rebuild a matcher: the
first sampling row of every admission (a new request, a re-prefill after a retract or an
executor restart, a restored or migrated turn) carries the spec and the output so far,
which the executor replays; every later row says how many output tokens its matcher must
have taken, and a matcher that disagrees refuses the step, naming the row
(docs/architecture.md, "Constrained decoding").
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

from shared.messages.envelope import I4, Arrays, WireError, empty

GrammarKind = Literal["json_schema", "regex", "ebnf", "structural_tag"]
MAX_GRAMMAR_SOURCE = 65536  # characters of a schema, regex or grammar
MAX_CLOSE_IDS = 64  # tokens of a reasoning block's end marker


class ReasoningPrefix(msgspec.Struct, frozen=True, kw_only=True):
    """Free reasoning before the constrained answer (a chat reply that thinks first):
    any text up to and including the first `close`, then the spec's own constraint.
    Once `budget` output tokens have gone by with the block still open, the executor
    forces `close_ids` (the tokenizer's encoding of `close`), one per step, so a model
    that never closes its reasoning still reaches its answer."""

    close: str
    close_ids: tuple[int, ...]
    budget: int

    def __post_init__(self) -> None:
        if not self.close or not self.close_ids or len(self.close_ids) > MAX_CLOSE_IDS:
            raise WireError(f"a reasoning end {self.close!r} of {len(self.close_ids)} tokens")
        if self.budget < 0 or any(t < 0 for t in self.close_ids):
            raise WireError(f"a reasoning budget {self.budget} or end ids {self.close_ids}")


class GrammarSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the output must match: a JSON schema (as JSON text), a regular expression, an
    EBNF grammar (xgrammar's dialect, as SGLang and vLLM take it) or an xgrammar
    structural tag (as JSON text); after `reasoning`, when the reply thinks first.
    `any_whitespace` False: JSON is written compactly, one space after `:` and `,`
    (xgrammar's fixed form), which bounds its length."""

    kind: GrammarKind
    source: str
    any_whitespace: bool = True
    reasoning: ReasoningPrefix | None = None

    def __post_init__(self) -> None:
        if len(self.source) > MAX_GRAMMAR_SOURCE:
            raise WireError(f"a {self.kind} of {len(self.source)} characters")

    @property
    def key(self) -> str:
        """The spec's identity, which a matcher is checked against."""
        prefix = self.reasoning
        forcing = "" if prefix is None else f"{list(prefix.close_ids)}\0{prefix.budget}"
        return _digest(f"{self.grammar_key}\0{forcing}")

    @property
    def grammar_key(self) -> str:
        """The identity of its grammar: the executor compiles each distinct one once
        (specs that differ only in their reasoning budget share it)."""
        close = "" if self.reasoning is None else self.reasoning.close
        return _digest(f"{self.kind}\0{int(self.any_whitespace)}\0{self.source}\0{close}")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class RowGrammar(Arrays, kw_only=True):
    """A constrained sampling row's grammar. `accepted`: the output tokens the matcher
    must have taken before this row samples (a future token counted: the executor took
    it when it sampled it). A row that starts the matcher carries its `spec` and the
    output so far (`replay`, of length `accepted`); the others carry the spec's `key`."""

    key: str
    accepted: int
    spec: GrammarSpec | None = None
    replay: I4 = msgspec.field(default_factory=empty(I4))

    def __post_init__(self) -> None:
        if self.accepted < 0:
            raise WireError(f"a grammar row that has accepted {self.accepted} tokens")
        if self.spec is not None and len(self.replay) != self.accepted:
            raise WireError(f"{len(self.replay)} tokens to replay for {self.accepted} accepted")
        if self.spec is not None and self.spec.key != self.key:
            raise WireError("a grammar row whose spec does not have its key")

    @property
    def starts(self) -> bool:
        return self.spec is not None


class GrammarCheck(msgspec.Struct, kw_only=True, tag="grammar_check"):
    """scheduler -> executor: compile `spec` (off the step loop) and answer on `reply`."""

    spec: GrammarSpec
    reply: str


class GrammarVerdict(msgspec.Struct, kw_only=True, tag="grammar_verdict"):
    """executor -> scheduler: None if `spec` compiled, else why not (a 400's message)."""

    error: str | None = None


decode_check = msgspec.msgpack.Decoder(GrammarCheck).decode
decode_verdict = msgspec.msgpack.Decoder(GrammarVerdict).decode
