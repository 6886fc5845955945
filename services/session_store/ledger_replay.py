"""The session store's independent ledger: the owner of every slot, rebuilt only from
the ownership stream, never from the scheduler's memory.

Every transfer is checked as it is replayed: a slot moved by someone who does not own it
is a double free or a use after free, reported at once with the slot, both owners and the
event number. At idle, any slot still held by running work is a leak, and the
scheduler's counts must equal the ones derived here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.scheduler.ownership.owners import KIND_BITS, KIND_MASK, OwnerKind
from shared.wire import EventBatch, WireError, unpack_ints

RUNNING_KINDS = (OwnerKind.REQUEST, OwnerKind.TRACK, OwnerKind.ADMISSION)


@dataclass(frozen=True)
class Violation:
    kind: str  # "double_free", "not_owner", "leak", "count_mismatch", "gap"
    pool: str
    slots: list[int]
    detail: str
    event: int | None  # ledger seq of the offending event, when there is one

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "pool": self.pool,
            "slots": self.slots,
            "detail": self.detail,
            "event": self.event,
        }


class IndependentLedger:
    def __init__(self) -> None:
        self.tables: list[list[int]] = []  # per pool id: owner id per slot
        self.names: list[str] = []
        self.owner_names: dict[int, str] = {}
        self.violations: list[Violation] = []
        self.double_frees = 0
        self.events_applied = 0
        self.next_event = 0

    @property
    def ready(self) -> bool:
        return bool(self.tables)

    def reset(self, snapshot: dict) -> None:
        self.tables, self.names = [], []
        for p in sorted(snapshot["pools"], key=lambda p: p["id"]):
            owners = unpack_ints(p["owners"])
            if len(owners) != p["capacity"] + 1:
                raise WireError(f"snapshot of pool {p['name']}: {len(owners)} owners")
            self.tables.append(owners.tolist())
            self.names.append(p["name"])
        self.owner_names = {int(k): v for k, v in snapshot.get("owners", {}).items()}
        self.next_event = snapshot["next_event"]

    def name(self, owner: int) -> str:
        if owner == 0:
            return "free"
        if owner < 0:
            return "sink"
        return (
            self.owner_names.get(owner)
            or f"{OwnerKind(owner & KIND_MASK).name.lower()}#{owner >> KIND_BITS}"
        )

    def apply(self, batch: EventBatch) -> list[Violation]:
        """Replay a batch in order; returns the violations it revealed."""
        if batch.first_event != self.next_event:
            found = Violation(
                "gap",
                "*",
                [],
                f"expected event {self.next_event}, got {batch.first_event}",
                batch.first_event,
            )
            self.violations.append(found)
            self.next_event = batch.first_event
            return [found]
        self.owner_names.update(batch.owners)
        found = []
        tables = self.tables
        for e, p, s, g, r in zip(
            batch.event.tolist(),
            batch.pool.tolist(),
            batch.slot.tolist(),
            batch.giver.tolist(),
            batch.receiver.tolist(),
            strict=True,
        ):
            own = tables[p]
            current = own[s]
            if current != g:
                found.append(self._misfit(batch, e, p, s, g, r, current))
            own[s] = r
        self.events_applied += batch.num_events
        self.next_event += batch.num_events
        self.violations += found
        return found

    def _misfit(
        self, batch: EventBatch, e: int, p: int, s: int, g: int, r: int, current: int
    ) -> Violation:
        seq = batch.first_event + e
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
    def counts(self) -> dict[str, dict[str, int]]:
        out = {}
        for name, table in zip(self.names, self.tables, strict=True):
            kinds = np.bincount(np.asarray(table[1:]) & KIND_MASK, minlength=len(OwnerKind))
            out[name] = {k.name.lower(): int(kinds[k]) for k in OwnerKind}
        return out

    def leaked(self) -> dict[str, list[int]]:
        """Slots held by running work: at idle, each is a leak."""
        out = {}
        for name, table in zip(self.names, self.tables, strict=True):
            kinds = np.asarray(table) & KIND_MASK
            held = np.flatnonzero(np.isin(kinds, [int(k) for k in RUNNING_KINDS]))
            held = held[held > 0]
            if len(held):
                out[name] = held.tolist()
        return out

    def check_idle(self, scheduler_counts: dict[str, dict[str, int]], seq: int) -> list[Violation]:
        found = [
            Violation(
                "leak",
                pool,
                slots,
                "held by running work at idle: "
                + ", ".join(
                    sorted({self.name(self.tables[self.names.index(pool)][s]) for s in slots})
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
        self.violations += found
        return found
