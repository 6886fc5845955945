"""Invariant checks over every pool, shared by the idle loop and the tests.

Holders (requests, sessions, cache nodes, track buffers, reservations) each state what
they believe they hold; the ledger knows who owns what. The check compares the two slot
by slot: a slot owned but claimed by nobody is a leak, a slot claimed by two holders is
counted twice, a slot claimed by someone who does not own it is a stale reference. Every
problem names the slot ids, their owners and the last event that moved each.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from services.scheduler.ownership.errors import InvariantViolation
from services.scheduler.ownership.ledger import Ledger
from services.scheduler.ownership.owners import KIND_MASK, Owner, OwnerKind

Claim = tuple[Owner, str, np.ndarray | list[int]]  # (owner, pool name, slots it holds there)
IDLE_FORBIDDEN = (OwnerKind.REQUEST, OwnerKind.TRACK, OwnerKind.TRANSIT, OwnerKind.SPECULATIVE)


@dataclass
class IntegrityReport:
    problems: list[str] = field(default_factory=list)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_integrity(ledger: Ledger, claims: Iterable[Claim], *, idle: bool) -> IntegrityReport:
    """Compare every holder's claims with the ledger. `idle` adds: nothing is held by a
    request, a track buffer or a tier move in transit."""
    report = IntegrityReport()
    claimed = {
        name: np.zeros(pool.capacity + 1, dtype=np.int64) for name, pool in ledger.pools.items()
    }
    for owner, pool_name, slots in claims:
        slots = np.asarray(slots, dtype=np.int64)
        if len(slots) == 0:
            continue
        table, pool = claimed[pool_name], ledger.pools[pool_name]
        twice = slots[(table[slots] != 0) | _repeated(slots)]
        if len(twice):
            others = sorted({ledger.owners.describe(int(o)) for o in table[twice] if o})
            report.problems.append(
                f"pool {pool_name}: slots {twice.tolist()} counted twice "
                f"(claimed by {owner} and {', '.join(others) or owner})\n"
                + ledger.describe(pool, twice)
            )
        table[slots] = owner.id
    for name, pool in ledger.pools.items():
        report.problems += pool.free_list_problems()
        owners, table = pool.owner_view[1:], claimed[name][1:]
        leaked = np.flatnonzero((owners != 0) & (table == 0)) + 1
        if len(leaked):
            report.problems.append(
                f"pool {name}: slots {leaked.tolist()} are held but claimed by no holder (leak)\n"
                + ledger.describe(pool, leaked)
            )
        stale = np.flatnonzero((table != 0) & (table != owners)) + 1
        if len(stale):
            report.problems.append(
                f"pool {name}: slots {stale.tolist()} are claimed by a holder that does not own "
                "them (stale reference)\n" + ledger.describe(pool, stale)
            )
        counts = pool.held_by_kind()
        report.counts[name] = {kind.name.lower(): n for kind, n in counts.items()}
        if sum(counts.values()) != pool.capacity or counts[OwnerKind.FREE] != pool.free_count:
            report.problems.append(f"pool {name}: counts do not add up to capacity: {counts}")
        if idle:
            busy = np.flatnonzero(np.isin(owners & KIND_MASK, [int(k) for k in IDLE_FORBIDDEN])) + 1
            if len(busy):
                report.problems.append(
                    f"pool {name}: idle, yet slots {busy.tolist()} are held by running work\n"
                    + ledger.describe(pool, busy)
                )
    return report


class InvariantGuard:
    """Runs the checks where they matter (the idle loop, after faults). Strict (tests,
    development) raises on the first violation; otherwise a violation is logged with its
    full report and counted, and the service keeps serving."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.failures = 0
        self.log = logging.getLogger("custody.invariants")

    def judge(self, report: IntegrityReport) -> IntegrityReport:
        if not report.ok:
            self.failures += 1
            if self.strict:
                raise InvariantViolation("\n".join(report.problems))
            self.log.error("ownership invariant violated:\n%s", "\n".join(report.problems))
        return report


def _repeated(slots: np.ndarray) -> np.ndarray:
    """Mask of entries whose slot appeared earlier in the same claim."""
    _, first = np.unique(slots, return_index=True)
    mask = np.ones(len(slots), dtype=bool)
    mask[first] = False
    return mask
