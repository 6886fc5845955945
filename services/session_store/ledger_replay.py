"""The session store's independent ledger: the owner of every slot, rebuilt only from
the ownership stream, never from the scheduler's memory.

Every transfer is checked as it is replayed: a slot moved by someone who does not own it
is a double free or a use after free, reported at once with the slot, both owners and the
event number. At idle, any slot still held by running work is a leak, and the
scheduler's counts must equal the ones derived here. Memory stays bounded: owners are
forgotten once they hold nothing (owner_book.py), and only the latest violations are
kept, with a count of every kind.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from services.session_store.owner_book import OwnerBook
from shared.messages.envelope import WireError
from shared.messages.ownership import Events, Snapshot, Transfers
from shared.owners import KIND_MASK, OwnerKind

RUNNING_KINDS = (OwnerKind.REQUEST, OwnerKind.TRACK, OwnerKind.TRANSIT, OwnerKind.SPECULATIVE)
KINDS = (
    "double_free",
    "not_owner",
    "leak",
    "count_mismatch",
    "gap",
    "misrouted_write",  # a step writes a slot its writer does not own (write_checker.py)
    "record_not_owned",  # a session record names slots the session does not own
)
KEEP_VIOLATIONS = 1000
# The checkpoint writes the owner tables in pages of this many slots, only those a batch
# changed: a decode step moves a few KV pages of a pool of hundreds of thousands.
CHECKPOINT_PAGE = 4096


@dataclass(frozen=True)
class Violation:
    kind: str  # one of KINDS
    pool: str
    slots: list[int]
    detail: str
    event: int | None  # ledger seq of the offending event (or of a step's plan)
    step: int | None = None  # the forward step, for a misrouted write
    expected: str | None = None  # who should own the slots
    actual: str | None = None  # who does

    def as_dict(self) -> dict:
        return asdict(self)


class IndependentLedger:
    def __init__(self) -> None:
        self.flat = np.zeros(0, np.int64)  # every pool's owner ids, one after another
        self.offsets = np.zeros(0, np.int64)  # where each pool starts in `flat`
        self.tables: list[np.ndarray] = []  # per pool id: its view of `flat`, per slot
        self.dirty: set[int] = set()  # pages of `flat` changed since a checkpoint took them
        self.names: list[str] = []
        self.owners = OwnerBook()
        self.violations: list[Violation] = []  # the latest KEEP_VIOLATIONS
        self.found: Counter[str] = Counter()  # every violation ever found, by kind
        self.double_frees = 0
        self.events_applied = 0
        self.next_event = 0

    @property
    def ready(self) -> bool:
        return bool(self.tables)

    def reset(self, snapshot: Snapshot) -> None:
        """Start over from a snapshot (its tables checked as it was decoded)."""
        self.names = [p.name for p in snapshot.pools]
        self.restore([p.owners for p in snapshot.pools])
        self.owners.reset(snapshot.owners, self.tables)
        self.next_event = snapshot.next_event

    def restore(self, tables: Sequence[np.ndarray]) -> None:
        """Take `tables` (a snapshot's, or a checkpoint's) as the owner tables, all
        dirty. They are views of one array, so a batch is replayed with one gather and
        one scatter whatever pools it touches."""
        sizes = [len(t) for t in tables]
        self.offsets = np.cumsum([0, *sizes[:-1]], dtype=np.int64)
        self.flat = np.concatenate([np.zeros(0, np.int64), *tables]).astype(np.int64)
        self.tables = [self.flat[o : o + n] for o, n in zip(self.offsets, sizes, strict=True)]
        self.dirty = set(range(-(-len(self.flat) // CHECKPOINT_PAGE)))

    @property
    def sizes(self) -> list[int]:
        """Each pool's slot count (the sink included), in pool id order."""
        return [len(t) for t in self.tables]

    def page(self, number: int) -> np.ndarray:
        """Page `number` of every table joined (`CHECKPOINT_PAGE` slots; the last one
        shorter)."""
        return self.flat[number * CHECKPOINT_PAGE : (number + 1) * CHECKPOINT_PAGE]

    def restore_pages(self, pages: Sequence[np.ndarray], sizes: Sequence[int]) -> None:
        """Take the tables from a checkpoint's pages, split by `sizes`."""
        flat = np.concatenate([np.zeros(0, np.int64), *pages])
        if len(flat) != sum(sizes):
            raise WireError(f"checkpoint pages hold {len(flat)} slots, its pools {sum(sizes)}")
        self.restore(np.split(flat, np.cumsum(sizes)[:-1]) if sizes else [])

    def owner_at(self, pool: str, slot: int) -> int | None:
        """The owner of `slot` of `pool`; None for the sink or a slot out of range."""
        table = self.tables[self.names.index(pool)]
        return int(table[slot]) if 0 < slot < len(table) else None

    def name(self, owner: int | None) -> str:
        return "nobody (the sink or out of range)" if owner is None else self.owners.name(owner)

    def report(self, found: list[Violation]) -> list[Violation]:
        """Record violations: counted by kind, the latest kept for /ledger."""
        self.found.update(v.kind for v in found)
        self.violations += found
        if len(self.violations) > 2 * KEEP_VIOLATIONS:  # amortised trim
            del self.violations[:-KEEP_VIOLATIONS]
        return found

    def apply(
        self,
        batch: Events,
        stops: Sequence[int] = (),
        on_stop: Callable[[int], list[Violation]] | None = None,
    ) -> list[Violation]:
        """Replay a batch in order; returns the violations it revealed. `on_stop(seq)`
        runs at each event number in `stops` (ascending, inside the batch) with the
        tables exactly as they were before event `seq`. A batch naming a pool or slot
        the tables do not have is refused (a WireError) before anything is applied."""
        if batch.first != self.next_event:
            found = Violation(
                "gap", "*", [], f"expected event {self.next_event}, got {batch.first}", batch.first
            )
            self.next_event = batch.first
            return self.report([found])
        records = batch.records()
        self._check_bounds(records)
        self.owners.declare(batch.owners)
        # each slot's owner before its move: the giver, unless a misfit
        before = np.empty(len(records.pool), np.int64)
        where = self.offsets[records.pool] + records.slot
        self.dirty.update(np.unique(where // CHECKPOINT_PAGE).tolist())
        cuts = np.searchsorted(records.event, [seq - batch.first for seq in stops])
        found: list[Violation] = []
        start = 0
        for seq, cut in zip(stops, cuts.tolist(), strict=True):
            found += self._replay(batch, records, where, before, start, cut)
            found += on_stop(seq)
            start = cut
        found += self._replay(batch, records, where, before, start, len(before))
        self.owners.moved(before, records.receiver, batch.owners)
        self.events_applied += batch.num_events
        self.next_event += batch.num_events
        return self.report(found)

    def _replay(
        self,
        batch: Events,
        records: Transfers,
        where: np.ndarray,
        before: np.ndarray,
        start: int,
        stop: int,
    ) -> list[Violation]:
        """Replay records `start`..`stop`-1 as if one at a time, in bulk: a slot moved
        k times in the span has its k-th move in the k-th round, and within a round every
        slot is distinct, so each round is one gather (checked against the givers) and
        one scatter. Returns the misfits, in event order."""
        if start == stop:
            return []
        n = stop - start
        order = np.argsort(where[start:stop], kind="stable")
        keys = where[start:stop][order]  # by slot, each slot's moves in event order
        first = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        rank = np.empty(n, np.int64)  # how many moves of its slot come before in the span
        rank[order] = np.arange(n) - np.repeat(first, np.diff(np.r_[first, n]))
        by_round = start + np.argsort(rank, kind="stable")  # each round in event order
        misfits = []
        for idx in np.split(by_round, np.cumsum(np.bincount(rank))[:-1]):
            at = where[idx]
            before[idx] = self.flat[at]
            misfits.append(idx[before[idx] != records.giver[idx]])
            self.flat[at] = records.receiver[idx]
        bad = np.sort(np.concatenate([np.zeros(0, np.int64), *misfits]))
        return [self._misfit(batch, records, int(i), int(before[i])) for i in bad]

    def _check_bounds(self, records: Transfers) -> None:
        """A record naming a pool or slot the tables lack would corrupt them (a negative
        slot indexes from the end): the batch is refused whole."""
        sizes = np.array([len(t) for t in self.tables])
        try:
            outside = records.slot.view("<u4") >= sizes[records.pool]  # negatives: huge
        except IndexError:
            raise WireError(f"events name a pool past the {len(sizes)} there are") from None
        if outside.any():
            bad = records.slot[outside].tolist()
            raise WireError(f"events name slots {bad} outside their pools")

    def _misfit(self, batch: Events, records: Transfers, i: int, current: int) -> Violation:
        e, p, s = int(records.event[i]), int(records.pool[i]), int(records.slot[i])
        g, r = int(records.giver[i]), int(records.receiver[i])
        seq = batch.first + e
        double = r == 0 and current == 0
        self.double_frees += double
        return Violation(
            "double_free" if double else "not_owner",
            self.names[p],
            [s],
            f"event #{seq} {batch.reasons[e]}: {self.name(g)} -> {self.name(r)}, but slot "
            f"{s} was owned by {self.name(current)}",
            seq,
        )

    # ---- views ----
    def counts(self, tables: list[np.ndarray] | None = None) -> dict[str, dict[str, int]]:
        out = {}
        for name, table in zip(self.names, self.tables if tables is None else tables, strict=True):
            kinds = np.bincount(
                np.asarray(table[1:], dtype=np.int64) & KIND_MASK, minlength=len(OwnerKind)
            )
            out[name] = {k.name.lower(): int(kinds[k]) for k in OwnerKind}
        return out

    def leaked(self, tables: list[np.ndarray] | None = None) -> dict[str, list[int]]:
        """Slots held by running work: at idle, each is a leak."""
        out = {}
        for name, table in zip(self.names, self.tables if tables is None else tables, strict=True):
            kinds = np.asarray(table) & KIND_MASK
            held = np.flatnonzero(np.isin(kinds, [int(k) for k in RUNNING_KINDS]))
            held = held[held > 0]
            if len(held):
                out[name] = held.tolist()
        return out

    def held_view(self) -> tuple[dict[str, dict[str, int]], dict[str, list[int]]]:
        """`counts` and `leaked` of one copy of the tables, for a reader on another thread
        than the one applying batches: read from the live tables one after the other,
        a batch applied in between showed nothing running and then a slot held by it."""
        flat = self.flat.copy()  # a batch is one scatter into it: before or after
        tables = [flat[o : o + len(t)] for o, t in zip(self.offsets, self.tables, strict=True)]
        return self.counts(tables), self.leaked(tables)

    def check_idle(self, scheduler_counts: dict[str, dict[str, int]], seq: int) -> list[Violation]:
        found = [
            Violation(
                "leak",
                pool,
                slots,
                "held by running work at idle: "
                + ", ".join(
                    sorted({self.name(int(self.tables[self.names.index(pool)][s])) for s in slots})
                ),
                None,
            )
            for pool, slots in self.leaked().items()
        ]
        mine = self.counts()
        for pool, counts in scheduler_counts.items():
            if mine.get(pool) != counts:
                found.append(
                    Violation(
                        "count_mismatch",
                        pool,
                        [],
                        f"scheduler counts {counts}, ledger counts {mine.get(pool)}",
                        None,
                    )
                )
        return self.report(found)
