"""An independent check of what every forward step writes: one that can catch scheduler
bugs, not only faults of delivery.

Replaying transfers can only see a slot moved by someone who does not own it; a
scheduler that plans a write into a slot it never transferred (a stale handle, a slot
reused too early) moves nothing and so shows nothing there. So the store also reads the
forward stream (its own consumer group) and checks, for every step, each slot the step
writes: a row's Mamba output slot (`mamba_out`) and the KV pages of positions
start..end (its KV indices // page_size, the pages the `kv` pool counts) must be the
row's request's, its snapshot slot its track's, a verify row's speculative slots its
speculative owner's (docs/speculative.md), and each clear or copy destination the
owner the step names for it, which must be a party of the step (a row's request, track
or session, the last for a turn's rollback copy).

Each step names `ledger_seq`, the scheduler ledger's event count when it was planned,
and is checked when the replayed ledger stands at exactly that event: then every owner
here is the owner the scheduler saw while planning, whatever moved later. Why the store
always gets there in time: the scheduler puts a step on the forward stream before any
ownership message holding an event numbered `ledger_seq` or later. The step is encoded
right after planning with no await between, so those events happen after it is encoded;
they leave the ledger only at a later drain, and only the scheduler's loop sends, one
round trip completed before the next begins. The consumer reads its ownership entries
first and then the forward stream to its end, so every step planned before an event it
is about to apply is queued by then; a batch is split at each queued step's number, and
a step whose number the ledger already stands at is checked as soon as it is read. A
step whose point is behind the ledger (after a snapshot past it) is counted unchecked,
never guessed at.

A row carries the KV indices of the positions it writes whether it sends its whole
context or only a delta (`StepRow.kv_from`): the checker needs no copy of the
executor's page tables, so none can go stale across a gap or a snapshot.

It cannot see a write the scheduler does not put in a step (the executor's own faults),
what a step reads (its read slot, the KV before `start`, copy sources), the content
written, or a slot that was right at planning but is reused while the step is still in
flight (the pipelining argument of engine/in_flight.py, not checked here). It trusts the
owner ids a step names, except that each must be of the right kind and, when its name
is known, carry the row's request id; so a write into a slot of another party of the
same step, stated as that party's, passes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np
import redis

from services.session_store.ledger_replay import IndependentLedger, Violation
from shared import streams
from shared.messages.envelope import WireError
from shared.messages.forward import decode_step
from shared.messages.step_rows import RowColumns
from shared.messages.tiers import TierMove
from shared.owners import KIND_MASK, OwnerKind, kind_of, label

GROUP = "write-checker"
MAX_QUEUED = 4096  # steps waiting for their ledger point; beyond it the oldest go unchecked
MAX_READ = 2048  # steps read per ownership poll


@dataclass(frozen=True)
class Write:
    pool: str
    slots: tuple[int, ...]
    owner: int  # who must own them; 0: any party of the step
    what: str


NOBODY = np.iinfo(np.int64).min  # the owner read at slot 0 (the sink) or out of range
# what a row writes, in the order checked
ROW_WRITES = ("mamba_out", "KV", "snapshot", "speculative state")


@dataclass
class RowWrites:
    """What a step's rows write, as arrays over the rows, so a step of hundreds of rows
    is parsed and checked in a few numpy operations: per row its request's owner, its
    track's, its session's (0: none), its Mamba output slot and its snapshot slot (0:
    none), per written KV page the row that writes it, and per speculative slot (a
    verify row's) the row that writes it; per row its speculative owner (0: none)."""

    rids: list[str]
    owner: np.ndarray
    track: np.ndarray
    session: np.ndarray
    mamba_out: np.ndarray
    snapshot: np.ndarray
    kv_row: np.ndarray
    kv_page: np.ndarray
    spec_owner: np.ndarray
    spec_row: np.ndarray
    spec_slot: np.ndarray

    @classmethod
    def of(cls, rows: RowColumns, page_size: int) -> RowWrites:
        """Read from the step's columns: no row is built."""
        row_of, written = rows.written_kv()
        pages = written // page_size
        # each page a row writes, once, by row then page (a malformed negative page too,
        # which the check then names: the keys count from the lowest page)
        low = int(pages.min()) if len(pages) else 0
        span = int(pages.max()) - low + 1 if len(pages) else 1
        key = np.unique(row_of * span + (pages - low))
        return cls(
            rows.rids,
            rows.owner,
            rows.track_owner,
            rows.session_owner,
            rows.mamba_out.astype(np.int64),
            rows.snapshot_slot.astype(np.int64),
            key // span,
            key % span + low,
            rows.spec_owner,
            np.repeat(np.arange(len(rows.rids)), rows.spec_counts),
            rows.spec.astype(np.int64),
        )

    def flat(self) -> tuple[np.ndarray, ...]:
        """(order, pool, slot, owner) over every write, `order` being 4 x row + the
        write's index in ROW_WRITES; pool 0 is mamba, 1 kv."""
        n, snapped, spec = len(self.rids), np.flatnonzero(self.snapshot), self.spec_row
        rows = np.arange(n)
        order = np.concatenate([4 * rows, 4 * self.kv_row + 1, 4 * snapped + 2, 4 * spec + 3])
        pool = np.zeros(len(order), np.int64)
        pool[n : n + len(self.kv_row)] = 1
        slot = np.concatenate(
            [self.mamba_out, self.kv_page, self.snapshot[snapped], self.spec_slot]
        )
        owner = np.concatenate(
            [self.owner, self.owner[self.kv_row], self.track[snapped], self.spec_owner[spec]]
        )
        by_order = np.argsort(order, kind="stable")
        return order[by_order], pool[by_order], slot[by_order], owner[by_order]


@dataclass
class PlannedStep:
    epoch: str
    step: int
    seq: int  # the ledger point it was planned at
    rows: RowWrites | None = None
    writes: list[Write] = field(default_factory=list)  # the ops' and the tier moves'
    parties: set[int] = field(default_factory=set)  # owners the step's rows name
    # the owners the rows name, each with the kind and the request it is named for
    claim_owners: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    claim_kinds: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    claim_rids: list[str] = field(default_factory=list)
    entry: bytes = b""  # its forward-stream entry, acknowledged once it is checked

    @classmethod
    def parse(cls, raw: bytes) -> PlannedStep | None:
        """The writes of a step message; None for a step naming no ledger point."""
        step = decode_step(raw)
        if step.ledger_seq is None:
            return None
        planned = cls(step.epoch, step.step, step.ledger_seq)
        planned.rows = rows = RowWrites.of(step.columns, max(1, step.page_size))
        planned._claim(rows)
        for dsts, owners, what in (
            (step.clears, step.clear_owners, "a clear"),
            (step.copies[:, 1], step.copy_owners, "a copy"),
        ):
            for dst, owner in zip(dsts.tolist(), owners.tolist(), strict=True):
                planned.writes.append(Write("mamba", (dst,), owner, what))
        for move in step.moves:
            planned._move(move)
        return planned

    def _move(self, move: TierMove) -> None:
        """A tier move writes its destination for the session it moves; a restore's
        device slots may already be its turn's (the same step admits it), so they must
        belong to a party of the step."""
        what = f"{move.kind} of session {move.sid}"
        if move.owner:
            self.parties.add(move.owner)
        if move.kind in ("spill", "adopt"):  # to a blob of this replica's disk tier
            self.writes.append(Write("disk", (move.dst_slot,), move.owner, what))
            return
        restore = move.kind == "restore"
        kv, mamba = ("kv", "mamba") if restore else ("host_kv", "host_mamba")
        owner = 0 if restore else move.owner
        self.writes.append(Write(kv, tuple(move.dst_pages.tolist()), owner, what))
        self.writes.append(Write(mamba, (move.dst_slot,), owner, what))

    def _claim(self, rows: RowWrites) -> None:
        """Each row names its request and its track, a session turn's row its session and
        a verify row its speculative owner: the claims `check` holds to the ledger, and
        the step's parties."""
        rids, n = rows.rids, len(rows.rids)
        turn = rows.session != 0  # a row of no session names none
        verify = np.zeros(n, bool)
        verify[rows.spec_row] = True
        self.claim_owners = np.concatenate(
            [rows.owner, rows.track, rows.session[turn], rows.spec_owner[verify]]
        )
        kinds = (OwnerKind.REQUEST, OwnerKind.TRACK, OwnerKind.SESSION, OwnerKind.SPECULATIVE)
        self.claim_kinds = np.repeat(
            np.array(kinds, np.int64), [n, n, int(turn.sum()), int(verify.sum())]
        )
        picked = lambda mask: [r for r, t in zip(rids, mask.tolist(), strict=True) if t]  # noqa: E731
        self.claim_rids = rids + rids + picked(turn) + picked(verify)
        named = self.claim_owners
        self.parties.update(np.unique(named[named != 0]).tolist())

    def _misnamed_claims(self, ledger: IndependentLedger) -> list[Violation]:
        """The claims naming an owner of another kind (the kind is in the id's low bits:
        one pass over the array), or one declared for another request (one lookup each;
        a session's name is not checked: the row does not carry its id). Each wrong
        claim once, in the order of (owner, kind, request)."""
        owners, kinds, rids = self.claim_owners, self.claim_kinds, self.claim_rids
        wrong = (owners == 0) | ((owners & KIND_MASK) != kinds)
        names, ids, kind_list = ledger.owners.names, owners.tolist(), kinds.tolist()
        prefix = {
            k: label(OwnerKind(k), "")
            for k in (OwnerKind.REQUEST, OwnerKind.TRACK, OwnerKind.SPECULATIVE)
        }
        for i in np.flatnonzero(~wrong & (kinds != OwnerKind.SESSION)).tolist():
            name = names.get(ids[i])
            if name is not None and name != prefix[kind_list[i]] + rids[i]:
                wrong[i] = True
        claims = {
            (ids[i], OwnerKind(kind_list[i]), rids[i]) for i in np.flatnonzero(wrong).tolist()
        }
        found = [self._misnamed(*claim, ledger) for claim in sorted(claims)]
        return [v for v in found if v is not None]

    def check(self, ledger: IndependentLedger) -> list[Violation]:
        """Every write against the ledger, which must stand at this step's point."""
        found = self._misnamed_claims(ledger)
        if self.rows is not None:
            found += self._check_rows(self.rows, ledger)
        for w in self.writes:
            outsider = bool(w.owner) and w.owner not in self.parties
            wrong: dict[int | None, list[int]] = {}
            for slot in w.slots:
                actual = ledger.owner_at(w.pool, slot)
                if outsider or (actual != w.owner if w.owner else actual not in self.parties):
                    wrong.setdefault(actual, []).append(slot)
            for actual, slots in wrong.items():
                found.append(self._violation(w, slots, actual, ledger, outsider))
        return found

    def _check_rows(self, rows: RowWrites, ledger: IndependentLedger) -> list[Violation]:
        """The rows' writes, as `check` does each op's, in one gather per pool."""
        order, pool, slot, owner = rows.flat()
        actual = np.full(len(slot), NOBODY)
        for code, name in enumerate(("mamba", "kv")):
            table = ledger.tables[ledger.names.index(name)]
            at = np.flatnonzero((pool == code) & (slot > 0) & (slot < len(table)))
            actual[at] = table[slot[at]]
        parties = np.fromiter(self.parties, np.int64, len(self.parties))
        outsider = (owner != 0) & ~np.isin(owner, parties)
        wrong = outsider | np.where(owner != 0, actual != owner, ~np.isin(actual, parties))
        found = []
        for o in np.unique(order[wrong]).tolist():
            mine = np.flatnonzero(wrong & (order == o))
            row, kind = divmod(o, 4)
            name = "kv" if kind == 1 else "mamba"
            w = Write(name, (), int(owner[mine[0]]), f"{ROW_WRITES[kind]} of {rows.rids[row]}")
            groups: dict[int | None, list[int]] = {}
            for a, s in zip(actual[mine].tolist(), slot[mine].tolist(), strict=True):
                groups.setdefault(None if a == NOBODY else a, []).append(s)
            for a, slots in groups.items():
                found.append(self._violation(w, slots, a, ledger, bool(outsider[mine[0]])))
        return found

    def _misnamed(
        self, owner: int, kind: OwnerKind, rid: str, ledger: IndependentLedger
    ) -> Violation | None:
        """An owner of the wrong kind, or one declared for another request (a session's
        name is not checked: the row does not carry its id)."""
        want = label(kind, rid) if kind is not OwnerKind.SESSION else "a session"
        name = ledger.owners.names.get(owner)
        right_name = name is None or kind is OwnerKind.SESSION or name == want
        if owner and kind_of(owner) is kind and right_name:
            return None
        return Violation(
            "misrouted_write",
            "*",
            [],
            f"step {self.step} (planned at event #{self.seq}) names owner "
            f"{ledger.name(owner)} as {want}",
            self.seq,
            self.step,
            want,
            ledger.name(owner),
        )

    def _violation(
        self,
        w: Write,
        slots: list[int],
        actual: int | None,
        ledger: IndependentLedger,
        outsider: bool,
    ) -> Violation:
        """`outsider`: the write names an owner that is no party of the step."""
        expected = ledger.name(w.owner) if w.owner and not outsider else "a party of the step"
        named = f" for {ledger.name(w.owner)}, no party of the step," if outsider else ""
        return Violation(
            "misrouted_write",
            w.pool,
            slots,
            f"step {self.step} (planned at event #{self.seq}) writes {w.what}{named} into "
            f"{w.pool} {slots}, owned by {ledger.name(actual)}, not {expected}",
            self.seq,
            self.step,
            expected,
            ledger.name(actual),
        )


class WriteChecker:
    """Steps read from the forward stream, queued until the ledger reaches their point.

    A step's stream entry is acknowledged (with the next checkpoint) only once the step
    is checked or its point has passed, so a restarted store reads the steps it had
    queued again as its pending entries; the checkpoint holds counts, never steps.
    """

    def __init__(self, client: redis.Redis, name: str, stream: str) -> None:
        self.stream = stream
        self.client, self.name = client, name
        self.queued: list[PlannedStep] = []  # by ledger point
        self.checked = self.unchecked = 0
        self._done: list[bytes] = []  # entry ids to acknowledge with the next checkpoint
        self._from: str | bytes = "0"  # pending entries of a previous life first, then ">"
        streams.ensure_group(client, stream, GROUP)

    # ---- reading ----
    def read(self, most: int = MAX_READ) -> None:
        """Queue the steps on the forward stream now (not blocking), at most `most` a
        call: a stream busier than the store must not starve the ledger; a step read
        after its point has passed is counted unchecked."""
        while most > 0:
            want = min(512, most)
            reply = self.client.xreadgroup(GROUP, self.name, {self.stream: self._from}, count=want)
            entries = reply[0][1] if reply else []
            for entry_id, fields in entries:
                if self._from != ">":
                    self._from = entry_id  # pending entries: go on after this one
                self._queue(entry_id, fields.get(b"m", b"") if fields else b"")
            most -= len(entries)
            if len(entries) < want:  # all there was: no second read to learn it
                if self._from == ">":
                    return
                self._from = ">"

    def _queue(self, entry: bytes, raw: bytes) -> None:
        try:
            planned = PlannedStep.parse(raw)
        except WireError:
            planned = None
        if planned is None:
            self.unchecked += 1
            self._done.append(entry)
            return
        planned.entry = entry
        bisect.insort(self.queued, planned, key=lambda p: p.seq)
        if len(self.queued) > MAX_QUEUED:
            self._done.append(self.queued.pop(0).entry)
            self.unchecked += 1

    # ---- checking ----
    def stops(self, epoch: str, first: int, end: int) -> list[int]:
        """Ledger points of queued steps strictly inside the events [first, end)."""
        return sorted({p.seq for p in self.queued if p.epoch == epoch and first < p.seq < end})

    def at(self, epoch: str, seq: int, ledger: IndependentLedger) -> list[Violation]:
        """The ledger stands at event `seq`: check the steps planned there, and count
        those planned before it as unchecked (their point has passed). Returns the
        violations, for the caller to report."""
        found, keep = [], []
        for planned in self.queued:
            if planned.epoch != epoch or planned.seq > seq:
                keep.append(planned)
                continue
            if planned.seq < seq:
                self.unchecked += 1
            else:
                found += planned.check(ledger)
                self.checked += 1
            self._done.append(planned.entry)
        self.queued = keep
        return found

    def reset(self, epoch: str) -> None:
        """A snapshot of `epoch`: steps of any other epoch will never be checked."""
        stale = [p for p in self.queued if p.epoch != epoch]
        self.unchecked += len(stale)
        self._done += [p.entry for p in stale]
        self.queued = [p for p in self.queued if p.epoch == epoch]

    # ---- checkpoint ----
    def ack(self, pipe: redis.client.Pipeline) -> None:
        """Acknowledge the steps finished with since the last checkpoint, in its
        transaction."""
        if self._done:
            pipe.xack(self.stream, GROUP, *self._done)
            self._done = []

    def state(self) -> dict:
        return {"checked": self.checked, "unchecked": self.unchecked}

    def load(self, state: dict) -> None:
        self.checked, self.unchecked = state["checked"], state["unchecked"]
