"""The forward path: a `Step` (scheduler -> executor, stream "forward", read by the
session store's write checker too) and its `StepResult` (executor -> scheduler, stream
"results").

One shape per row on both sides: the scheduler plans a `StepRow`, and the executor runs
the rows it decodes; between them a step's rows travel as columns (step_rows.py), which
the session store checks without building a row. Integer arrays travel packed (`<i4`, owner ids
`<i8`, log probabilities `<f4`: array fields, envelope.py). Decoding checks what the
types cannot: every packed length, and the arrays that must agree (a KV index per
position, an owner per op, a token per sampling row).

A row's KV indices travel as a delta: the executor keeps each request row's page table
(services/executor/page_tables.py), so a row sends only the positions from `kv_from`
on, which always include the positions it writes. A step's size then follows the
tokens it computes, not the contexts it reads (docs/architecture.md, "Step deltas").
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import cached_property

import msgspec

from shared.deferred_ops import DeferredOps
from shared.messages.envelope import (
    F4,
    I4,
    I8,
    Arrays,
    Decoder,
    Message,
    WireError,
    array,
    empty,
)
from shared.messages.sampling import RowScores, Top, pack_top, unpack_top
from shared.messages.step_rows import RowColumns, StepRow
from shared.messages.tiers import TierMove

__all__ = ["Step", "StepHead", "StepResult", "StepRow"]  # StepRow: where it is imported from


class StepHead(Message, tag="step", kw_only=True):
    """What the executor reads of a step even when the rest is malformed, so that it can
    answer: the scheduler life that sent it (`epoch`), its number in that life (`seq`),
    and the executor life it was planned for (a step for an earlier one is dropped)."""

    executor_epoch: str

    @property
    def step(self) -> int:
        return self.seq


class Step(StepHead, Arrays, tag="step", kw_only=True, dict=True):
    """A forward step. `after`: the step it was planned on top of (its rows read the
    state that step writes, and its future tokens are that step's samples), or None when
    it builds on nothing in flight; the executor refuses it unless `after` is the step
    it ran last. Its deferred ops run first: `clears`, then the `(source, destination)`
    pairs of `copies`.

    For the session store's check of its writes: `ledger_seq`, the number of ownership
    events the scheduler's ledger held when it was planned (every slot it writes must be
    its writer's at exactly that point; None: not checked); `page_size`, to turn KV
    indices into the pages the ledger counts; `clear_owners` and `copy_owners`, the
    owner each op's destination is written for, one per clear and per copy.

    `moves` carry sessions' state between tiers and `discards` name disk blobs to delete
    (shared/messages/tiers.py): both run before the deferred ops. A step may have no
    rows when it only moves state."""

    after: int | None
    columns: RowColumns = msgspec.field(name="rows")  # the rows as they travel
    clears: I4
    copies: I4  # [n, 2]: source, destination; flat on the wire
    clear_owners: I8
    copy_owners: I8
    ledger_seq: int | None = None
    page_size: int = 0
    moves: list[TierMove] = msgspec.field(default_factory=list)
    discards: list[int] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        copied = self.copies.size
        if copied % 2:
            raise WireError(f"copies: {copied} slots, not (source, destination) pairs")
        self.copies = self.copies.reshape(-1, 2)
        if len(self.clear_owners) != len(self.clears):
            raise WireError(f"{len(self.clear_owners)} owners for {len(self.clears)} clears")
        if len(self.copy_owners) != copied // 2:
            raise WireError(f"{len(self.copy_owners)} owners for {copied // 2} copies")

    @classmethod
    def of(
        cls,
        epoch: str,
        step: int,
        executor_epoch: str,
        rows: list[StepRow],
        ops: DeferredOps,
        *,
        after: int | None = None,
        ledger_seq: int | None = None,
        page_size: int = 0,
        moves: list[TierMove] | None = None,
        discards: list[int] | None = None,
    ) -> Step:
        """The step numbered `step` in scheduler life `epoch`; each op destination's
        owner is taken from `ops.owners` (0 where it names none)."""
        message = cls(
            epoch=epoch,
            seq=step,
            executor_epoch=executor_epoch,
            after=after,
            columns=RowColumns.of(rows),
            clears=array(ops.clears, I4),
            copies=array(ops.copies, I4),
            clear_owners=array([ops.owners.get(s, 0) for s in ops.clears], I8),
            copy_owners=array([ops.owners.get(d, 0) for _, d in ops.copies], I8),
            ledger_seq=ledger_seq,
            page_size=page_size,
            moves=moves or [],
            discards=discards or [],
        )
        message.__dict__["rows"] = rows  # the planner's own rows: none to rebuild
        return message

    @cached_property
    def rows(self) -> list[StepRow]:
        """The rows, built from the columns once (the executor's side)."""
        return self.columns.rows()

    def ops(self) -> DeferredOps:
        """The deferred ops, as the executor runs them."""
        pairs = [(src, dst) for src, dst in self.copies.tolist()]
        return DeferredOps(self.clears.tolist(), pairs)


class ResultHead(Message, tag="result", kw_only=True):
    """What the scheduler reads of a result even when the rest is malformed: the executor
    life (`epoch`), the step (`seq`) and the scheduler life it answers, so that an answer
    to the step in flight is never passed over as if it had not come."""

    scheduler_epoch: str


class StepResult(Message, Arrays, tag="result", kw_only=True):
    """The executor's answer to a step: `epoch` is the executor's life, `seq` the step's
    number. Per sampling row (`rids`, in row order) the token sampled, the model's log
    probability of it and the top log probabilities the row asked for (`top`); or
    `error`, why the step was refused or failed. `ops_ran` (with an error): every
    deferred op had been applied when it failed, so a rollback copy they made holds the
    state it copied; False: the forward did not run, the sources of its copies hold what
    they held, and its destinations may not. `failed_moves`: the indices (in
    `Step.moves`) of tier moves that did not happen while the step ran on (a blob that
    failed its checksum, a disk that refused a write); their destinations hold nothing.
    `scores`: the input log probabilities of the rows that scored positions.
    `grammar_ended`: the constrained rows whose grammar can only end after the token
    they sampled (the request stops there). `counts`: per sampling row, how many of
    `tokens` (and `logprobs`) are its, in order, where a verify row (StepRow.drafts)
    gave more than one; empty: one each. `drafts`, `draft_counts`: per sampling row, the
    MTP head's guesses for its next row (StepRow.propose), in row order; empty: none."""

    scheduler_epoch: str  # step numbers restart with each scheduler life
    rids: list[str]
    tokens: I4
    logprobs: F4
    counts: I4 = msgspec.field(default_factory=empty(I4))
    drafts: I4 = msgspec.field(default_factory=empty(I4))
    draft_counts: I4 = msgspec.field(default_factory=empty(I4))
    error: str | None = None
    ops_ran: bool = False
    failed_moves: list[int] = msgspec.field(default_factory=list)
    top_counts: I4 = msgspec.field(default_factory=empty(I4))
    top_ids: I4 = msgspec.field(default_factory=empty(I4))
    top_logprobs: F4 = msgspec.field(default_factory=empty(F4))
    scores: list[RowScores] = msgspec.field(default_factory=list)
    grammar_ended: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        n, lp, rows = len(self.tokens), len(self.logprobs), len(self.rids)
        if self.error is not None:
            return
        counts = self.counts
        if len(counts) and (len(counts) != rows or counts.min() < 1 or counts.sum() != n):
            raise WireError(f"token counts {counts.tolist()} for {n} tokens of {rows} rows")
        if not n == lp == (rows if not len(counts) else n):
            raise WireError(f"{n} tokens and {lp} log probabilities for {rows} rows")
        unpack_top(self.top_counts, self.top_ids, self.top_logprobs, rows)
        guesses = self.draft_counts
        if len(guesses) and (
            len(guesses) != rows or guesses.min() < 0 or guesses.sum() != len(self.drafts)
        ):
            raise WireError(f"draft counts {guesses.tolist()} for {len(self.drafts)} drafts")

    def drafts_by_row(self) -> dict[str, list[int]]:
        """The head's guesses, by sampling row (rows without any left out)."""
        if not len(self.draft_counts):
            return {}
        drafts, out, at = self.drafts.tolist(), {}, 0
        for rid, n in zip(self.rids, self.draft_counts.tolist(), strict=True):
            if n:
                out[rid] = drafts[at : at + n]
            at += n
        return out

    def per_row(self) -> tuple[list[list[int]], list[list[float]]]:
        """Each sampling row's tokens and their log probabilities, in row order."""
        tokens, logprobs = self.tokens.tolist(), self.logprobs.tolist()
        if not len(self.counts):
            return [[t] for t in tokens], [[x] for x in logprobs]
        ends = list(itertools.accumulate(self.counts.tolist()))
        spans = [slice(a, b) for a, b in zip([0, *ends], ends, strict=False)]
        return [tokens[s] for s in spans], [logprobs[s] for s in spans]

    @classmethod
    def of(
        cls,
        executor_epoch: str,
        step: int,
        scheduler_epoch: str,
        rids: list[str],
        tokens: Sequence[int] = (),
        logprobs: Sequence[float] = (),
        *,
        error: str | None = None,
        ops_ran: bool = False,
        failed_moves: list[int] | None = None,
        top: Sequence[Top] = (),
        scores: Sequence[RowScores] = (),
        grammar_ended: Sequence[str] = (),
        counts: Sequence[int] = (),
        drafts: Sequence[Sequence[int]] = (),
    ) -> StepResult:
        """`counts`: per row, its count of `tokens` (empty: one each); `drafts`: per row,
        the head's guesses (empty: none)."""
        top_counts, top_ids, top_logprobs = pack_top(top)
        return cls(
            epoch=executor_epoch,
            seq=step,
            scheduler_epoch=scheduler_epoch,
            rids=rids,
            tokens=array(tokens, I4),
            logprobs=array(logprobs, F4),
            error=error,
            ops_ran=ops_ran,
            failed_moves=failed_moves or [],
            counts=array(counts if any(c != 1 for c in counts) else (), I4),
            drafts=array([t for row in drafts for t in row], I4),
            draft_counts=array([len(row) for row in drafts] if any(drafts) else (), I4),
            top_counts=top_counts,
            top_ids=top_ids,
            top_logprobs=top_logprobs,
            scores=list(scores),
            grammar_ended=list(grammar_ended),
        )

    @property
    def step(self) -> int:
        return self.seq

    @property
    def top(self) -> list[Top]:
        """Per sampling row, its top ids and their log probabilities (empty where the
        row asked for none)."""
        return unpack_top(self.top_counts, self.top_ids, self.top_logprobs, len(self.rids))

    @property
    def executor_epoch(self) -> str:
        return self.epoch


decode_step = Decoder(Step).decode
decode_step_head = Decoder(StepHead).decode
decode_result = Decoder(StepResult).decode
decode_result_head = Decoder(ResultHead).decode
