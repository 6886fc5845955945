"""Session records checked against the replayed ledger.

A record that names a row, a Mamba slot and KV pages says the session holds them: a
restarted scheduler takes them back on its word. So each must be the session's at the
point the record was taken, which is exactly where the replayed ledger stands when the
record's message is applied: the scheduler takes the records right after draining the
events before them, with no await between, and ships them in that order.
"""

from __future__ import annotations

from services.session_store.ledger_replay import IndependentLedger, Violation
from shared.messages.ownership import SessionRecord
from shared.owners import OwnerKind, label


def check_records(ledger: IndependentLedger, records: list[SessionRecord]) -> list[Violation]:
    """The violations the records reveal, for the caller to report; a closed session's
    owner is forgotten once it holds nothing."""
    found = []
    for rec in records:
        sid = rec.sid
        if rec.closed:
            ledger.owners.closed(sid)
            continue
        if rec.disk is not None:
            claimed: tuple = (("disk", [rec.disk]),)
        elif rec.row is not None:
            claimed = (
                ("req", [rec.row]),
                ("mamba", [rec.working]),
                ("kv", rec.kv_pages().tolist()),
            )
        else:
            continue  # history only: lent to a turn, on the host, or dropped
        owner = ledger.owners.session(sid)
        for pool, slots in claimed:
            wrong: dict[int | None, list[int]] = {}
            for slot in slots:
                actual = ledger.owner_at(pool, slot)
                if owner is None or actual != owner:
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
                        expected=label(OwnerKind.SESSION, sid),
                        actual=name,
                    )
                )
    return found
