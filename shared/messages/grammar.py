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


class GrammarSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the output must match: a JSON schema (as JSON text), a regular expression, an
    EBNF grammar (xgrammar's dialect, as SGLang and vLLM take it) or an xgrammar
    structural tag (as JSON text). `any_whitespace` False: JSON is written compactly,
    one space after `:` and `,` (xgrammar's fixed form), which bounds its length."""

    kind: GrammarKind
    source: str
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        if len(self.source) > MAX_GRAMMAR_SOURCE:
            raise WireError(f"a {self.kind} of {len(self.source)} characters")

    @property
    def key(self) -> str:
        """The spec's identity: the executor compiles each distinct key once."""
        text = f"{self.kind}\0{int(self.any_whitespace)}\0{self.source}"
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
