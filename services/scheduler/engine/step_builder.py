"""Turning the requests chosen for a step into what the executor runs: one batched KV
allocation for the whole step, then a row per request with its tokens (a future token
where the step in flight samples it), KV indices, the Mamba slots it reads and writes
and, where one is due, the track slot and length of a snapshot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.scheduler.allocators.paged_kv import pages_for
from services.scheduler.allocators.pools import Pools
from services.scheduler.records.request import Request
from services.scheduler.records.row_plan import RowPlan
from shared.messages.envelope import I4, array
from shared.messages.forward import StepRow
from shared.messages.grammar import RowGrammar
from shared.messages.sampling import Penalties

FUTURE_TOKEN = -1  # placeholder for a token the step in flight samples


def _frozen(values: tuple[int, ...]) -> np.ndarray:
    """An I4 array many rows share: read-only, so no row can change another's."""
    out = array(values, I4)
    out.flags.writeable = False
    return out


# the tokens of a row fed the token the step in flight samples, and a row's scored
# positions (or speculative slots) when it has none: most decoding rows of every step,
# one array each
FUTURE_ROW = _frozen((FUTURE_TOKEN,))
NO_INTS = _frozen(())


def pages_to_grow(page_size: int, length: int, n: int) -> int:
    return pages_for(length + n, page_size) - pages_for(length, page_size)


def cut_at_checkpoint(req: Request, start: int, n: int, interval: int, page_size: int) -> int:
    """`n` positions from `start`, cut so the chunk ends at the first checkpoint it would
    pass: the request's junction, a chat turn's reply start and the page boundary before
    it, or (`interval` > 0) a multiple of `interval`. A chunk snapshots its state where it
    ends on a page, so the state there can be cached (and at the reply start, for its
    session; the page before it is the turn's kept boundary, docs/ownership.md)."""
    if n <= 1:  # every stop is past `start`: nothing to cut (a decoding row)
        return n
    reply = req.reply_start
    stops = [c for c in (req.checkpoint, reply, reply - reply % page_size) if start < c]
    if interval:
        stops.append(start - start % interval + interval)
    return min([n, *(stop - start for stop in stops)])


def awaits_track_slot(req: Request, n: int) -> bool:
    """A chunk of `n` positions that ends at a chat turn's reply start must snapshot
    there: the session keeps that state (sessions/manager.py, `_keep_reply_start`). While
    both track entries are busy (the latest snapshot, and one a step in flight writes) it
    waits for that step rather than run without the snapshot."""
    return req.planned + n == req.reply_start and not req.slots.track.can_snapshot()


def grow_kv(pools: Pools, chosen: list[tuple[Request, int]]) -> None:
    """One batched KV allocation for the whole step: decodes, then chunks."""
    count = len(chosen)
    rows = np.fromiter((r.slots.row.slot for r, _ in chosen), np.int64, count)
    planned = np.fromiter((r.planned for r, _ in chosen), np.int64, count)
    ns = np.fromiter((n for _, n in chosen), np.int64, count)
    drifted = np.flatnonzero(pools.rows.lens[rows] != planned)
    if len(drifted):
        raise AssertionError(f"{chosen[drifted[0]][0].rid}: KV length drifted")
    one = ns == 1
    if one.any():
        pools.kv.decode(rows[one])
    more = ns > 1
    if more.any():
        pools.kv.extend(rows[more], planned[more] + ns[more])


def row_plan(
    pools: Pools,
    track_interval: int,
    req: Request,
    n: int,
    step: int,
    drafts: Sequence[int] = (),
    propose: int = 0,
) -> RowPlan:
    """The row of step `step` for `req`, computing `n` positions after those already
    planned, the last len(`drafts`) of them a verify row's drafts; `propose`: guesses
    the MTP head makes from it (StepRow.propose). A chunk
    snapshots at the last page boundary it reaches, except the last chunk of a sequence
    that ends on a page boundary: it snapshots one page earlier (if that is still in the
    chunk), since a match must leave a token to compute and a snapshot at the very end
    would serve no repeat of the same sequence. A decode step snapshots every
    `track_interval` positions: a verify row at the last multiple it reaches, which
    counts only if the drafts before it are accepted (completion.py)."""
    ps, start = pools.config.page_size, req.planned
    end = start + n
    pending = req.pending_tokens  # sampled by steps in flight: positions length.. of them
    future = pending > 0  # then this row is the last of them, at position req.planned
    fed = n - len(drafts)  # positions of known tokens
    if fed > 1:
        snap_len = end - end % ps
        if snap_len == end == req.length and end - ps > start:
            snap_len = end - ps
    else:
        snap_len = end - end % track_interval
    if req.reply_start and end >= req.reply_start:  # that state, and none after it
        snap_len = end if end == req.reply_start else 0
    slot = 0
    if snap_len > max(start, req.slots.track.latest_len):
        slot = req.slots.track.begin_snapshot() or 0
    read, write = req.slots.state.advance()
    # the last prompt position samples the first output token, unless none is wanted (a
    # prefill-only request: max_new_tokens 0)
    params = req.params
    sample = start + fed == req.length + pending and params.max_new_tokens > 0
    tokens = FUTURE_ROW if future else array(req.tokens_at(start, start + fed), I4)
    spec = req.slots.spec
    if drafts:
        tokens = array([*tokens.tolist(), *drafts], I4)
    scored = req.scored(start, end)
    row_slot = req.slots.row.slot
    kv_from, kv = pools.rows.delta(row_slot, req.rid, start, end)
    # built field by field (not StepRow.of): this runs for every row of every step
    wire = StepRow(
        rid=req.rid,
        tokens=tokens,
        start=start,
        kv_indices=array(kv, I4),
        kv_from=kv_from,
        row=row_slot,
        mamba_slot=read,
        mamba_out=write,
        snapshot_slot=slot,
        snapshot_len=snap_len if slot else 0,
        sample=sample,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        min_p=params.min_p,
        penalties=penalties(req) if sample and params.penalised else None,
        top_logprobs=params.top_logprobs,
        future=future,
        scored_from=scored.start,
        scored=array(req.prompt[scored.start + 1 : scored.stop + 1], I4) if scored else NO_INTS,
        grammar=row_grammar(req) if sample else None,
        spec_slots=array(spec.for_drafts(len(drafts)), I4) if drafts else NO_INTS,
        owner=req.slots.owner.id,
        track_owner=req.slots.track.owner.id,
        session_owner=req.session.owner.id if req.session is not None else 0,
        spec_owner=spec.owner.id if drafts else 0,
        propose=propose,
    )
    row = RowPlan(wire, prefill=fed > 1 or start < len(req.prompt), step=step)
    req.inflight.append(row)
    return row


def row_grammar(req: Request) -> RowGrammar | None:
    """The grammar of `req`'s sampling row being planned (None: unconstrained). The
    first of an admission starts the executor's matcher with the output so far; the
    others say how many tokens it has taken by then, the rows in flight's included
    (shared/messages/grammar.py)."""
    spec = req.params.grammar
    if spec is None:
        return None
    accepted = len(req.output) + sum(1 for r in req.inflight if r.sample)
    if req.grammar_started:
        return RowGrammar(key=spec.key, accepted=accepted)
    req.grammar_started = True
    return RowGrammar(key=spec.key, accepted=accepted, spec=spec, replay=array(req.output, I4))


def penalties(req: Request) -> Penalties:
    """What the executor needs to penalise `req`'s next token: no one keeps counts
    between steps (shared/messages/sampling.py). A future token is counted there."""
    p = req.params
    return Penalties.of(
        p.repetition_penalty, p.frequency_penalty, p.presence_penalty, req.prompt, req.output
    )


@dataclass
class StepBudget:
    """What the step being planned has taken so far."""

    tokens: int
    pages: int = 0

    def take(self, tokens: int, pages: int) -> None:
        self.tokens -= tokens
        self.pages += pages
