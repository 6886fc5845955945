"""Session records checked against the replayed ledger.

A record that names a row, a Mamba slot and KV pages says the session holds them: a
restarted scheduler takes them back on its word. So each must be the session's at the
point the record was taken, which is exactly where the replayed ledger stands when the
record's message is applied: the scheduler takes the records right after draining the
events before them, with no await between, and ships them in that order. The first
`shared_pages` pages are borrowed from the prefix cache: each must be a cache node's.
"""

from __future__ import annotations

from services.session_store.ledger_replay import IndependentLedger, Violation
from shared.messages.ownership import SessionRecord
from shared.owners import OwnerKind, kind_of, label


def check_records(ledger: IndependentLedger, records: list[SessionRecord]) -> list[Violation]:
    """The violations the records reveal, for the caller to report; a closed session's
    owner is forgotten once it holds nothing."""
    found = []
    for rec in records:
        sid = rec.sid
        if rec.closed:
            ledger.owners.closed(sid)
            continue
        owner = ledger.owners.session(sid)
        session = label(OwnerKind.SESSION, sid)

        def its_own(actual: int | None, owner: int | None = owner) -> bool:
            return owner is not None and actual == owner

        def a_cache_node_s(actual: int | None) -> bool:
            return actual is not None and actual > 0 and kind_of(actual) is OwnerKind.CACHE

        if rec.disk is not None:
            claimed: tuple = (("disk", [rec.disk], its_own, session),)
        elif rec.row is not None:
            pages = rec.kv_pages().tolist()
            claimed = (
                ("req", [rec.row], its_own, session),
                ("mamba", [rec.working], its_own, session),
                ("kv", pages[rec.shared_pages :], its_own, session),
                ("kv", pages[: rec.shared_pages], a_cache_node_s, "a cache node"),
            )
        else:
            continue  # history only: lent to a turn, on the host, or dropped
        for pool, slots, expected, expected_name in claimed:
            wrong: dict[int | None, list[int]] = {}
            for slot in slots:
                actual = ledger.owner_at(pool, slot)
                if not expected(actual):
                    wrong.setdefault(actual, []).append(slot)
            for actual, bad in wrong.items():
                name = ledger.name(actual)
                found.append(
                    Violation(
                        "record_not_owned",
                        pool,
                        bad,
                        f"the record of session {sid} names {pool} {bad}, owned by {name}",
                        None,
                        expected=expected_name,
                        actual=name,
                    )
                )
    return found
