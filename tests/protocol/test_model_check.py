"""The session protocol's moves, explored exhaustively at a bound (tests/protocol/world.py,
checker.py): production's transitions (protocol/moves.py, protocol/copies.py) hold every
safety property in every reachable state and can always settle; and bugs planted as
earlier builds decided them are each found, with the shortest trace printed.

The bound, printed by each run: one session on two replicas, a front beginning at most
two moves of it one at a time (a move, and an attempt after an abort), a second front
taking over moves whose lease ran out, two client turns, and at most two faults per
trace (a call's request or reply lost, or the call delayed past later events; a front
dying or stalling past its lease). What it cannot catch: anything outside the model
(replica lives and leases, the store, opens and closes, the fronts' memory: see
world.py), and what needs a third fault."""

from __future__ import annotations

from dataclasses import replace

from tests.protocol.checker import explore
from tests.protocol.world import Rules, World

FAULTS = 2


def run(rules: Rules) -> object:
    report = explore(rules, replace(World(), faults_left=FAULTS))
    print(
        f"bound: 2 replicas, 1 session, 2 moves one at a time, 2 turns, {FAULTS} faults; "
        f"{report.states} states, {report.edges} transitions explored; longest shortest "
        f"fault-free schedule to settle N = {report.depth}"
    )
    for what, trace in report.violations[:1]:
        print(report.first())
        assert trace, what
    return report


def test_production_moves_keep_every_turn_and_always_settle():
    report = run(Rules())
    assert report.states > 10_000 and report.depth > 5  # it explored, and settles take work
    assert not report.violations, report.first()


def test_an_arrival_that_ignores_the_attempt_is_found():
    """Before nonces, a copy an undone attempt left on the target passed for the next
    attempt's arrival (an abort restores the same epoch): the next turns ran two turns
    short, 200, no alarm."""
    report = run(Rules(same_attempt=lambda copy, nonce: copy is not None))
    assert report.violations and "missing from the history" in report.violations[0][0]


def test_a_settle_sent_once_is_found():
    """Before settles were retried and replicas settled their copies from the directory,
    a lost `migrate_cancel` left the source's copy leaving for good."""
    report = run(Rules(restores_undone=False, unlist_unanswered=True))
    assert report.violations and report.violations[0][0].startswith("wedged")
