"""Where a verify step's drafts come from, behind one small interface.

A drafter guesses the next tokens of a request from what the scheduler knows of it (its
prompt and output); the executor's verify step keeps the guesses the target agrees with
(docs/speculative.md). Which requests speculate is decided here too: a row with a
grammar, penalties or top log probabilities is never verified (the executor samples
those one token at a time, `services/executor/verify.py` says why), so such a request
decodes as it would with speculation off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from services.scheduler.records.request import Request


class Drafter(Protocol):
    # whether the executor's MTP head makes the guesses (every row of a request that
    # speculates then feeds it: StepRow.propose)
    by_head: bool

    def propose(self, req: Request, n: int) -> list[int]:
        """Up to `n` guesses of the tokens after `req.sequence` (fewer, or none)."""
        ...


class PromptNgram:
    """SGLang's NGRAM idea in its plainest form: find the latest earlier occurrence of
    the sequence's last `longest` tokens (then of fewer, down to `shortest`) and guess
    the tokens that followed it. It costs no model and wins where text repeats: code
    edits, quoted context, structured output."""

    by_head = False

    def __init__(self, longest: int = 4, shortest: int = 1) -> None:
        self.longest, self.shortest = longest, shortest

    def propose(self, req: Request, n: int) -> list[int]:
        seq = req.sequence
        for k in range(min(self.longest, len(seq) - 1), self.shortest - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], k)
            hits = np.flatnonzero((windows == seq[-k:]).all(axis=1))
            if len(hits):
                after = int(hits[-1]) + k
                return seq[after : after + n].tolist()
        return []


class RepeatLast:
    """The trivial draft a real one must beat: the last token, `n` times."""

    by_head = False

    def propose(self, req: Request, n: int) -> list[int]:
        return [req.output[-1] if req.output else int(req.prompt[-1])] * n


class HeadDrafts:
    """The checkpoint's MTP head (NEXTN, EAGLE): the executor runs it after each row and
    returns its guesses with the step's result; they are the request's until its next
    row (`Request.head_drafts`). Nothing else holds them: a guess that is stale (after a
    retract, a restart) can only be rejected."""

    by_head = True

    def propose(self, req: Request, n: int) -> list[int]:
        return req.head_drafts[:n]


def verifiable(req: Request) -> bool:
    """Whether `req`'s decode rows may carry drafts: none of what the executor samples
    one token at a time (a grammar, penalties, top log probabilities)."""
    params = req.params
    return params.grammar is None and not params.penalised and not params.top_logprobs


@dataclass
class Acceptance:
    """What verify steps accepted, as SGLang reports it (`avg_spec_accept_length`: the
    tokens a verify step gives, its accepted drafts and one more) and per draft
    position (how often the i-th draft of a row was accepted, of the rows that had one)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    at_position: list[int] = field(default_factory=list)  # accepted at draft position i
    offered_at: list[int] = field(default_factory=list)  # rows with a draft at position i

    def record(self, drafts: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafts
        self.accepted += accepted
        grow = drafts - len(self.offered_at)
        if grow > 0:
            self.offered_at += [0] * grow
            self.at_position += [0] * grow
        for i in range(drafts):
            self.offered_at[i] += 1
            self.at_position[i] += i < accepted

    @property
    def mean_length(self) -> float:
        """Tokens per verify step (1.0 before any)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 1.0
