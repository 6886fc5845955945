"""The session protocol explored exhaustively at a bound (tests/protocol/world.py,
checker.py): production's transitions (protocol/moves.py, copies.py, lives.py,
records.py) hold every safety property in every reachable state and can always settle;
and bugs planted as earlier builds decided them are each found, with the shortest trace
printed.

The bounds, printed by each run:
- `BOUND`: one session on two replicas, one of which may crash and start a second life;
  a drain's front beginning one move; a second front taking over moves whose lease ran
  out; a third, holding the duties, re-homing a replica it finds dead (one move); two
  client turns; and one fault per trace, of any kind: a call's request or reply lost,
  the call delayed past later events or duplicated; a directory write refused or
  applied twice; a front stalling past its lease; a client's turn delayed; a replica's
  life crashing or pausing past its lease; a replica's unapplied records lost (a gap).
- `TWO_FAULTS`: two faults of the kinds a move meets, over one move (no crash).
- `TWO_SESSIONS`: `BOUND` with two sessions on the same replica (one turn of one of
  them), so a crash, a pause, a gap, a fence and a re-homing act on both.
- `CLOSES`: `BOUND` without a crash, its client closing the session (its record written
  after the close, so a pause can fall between).

What it cannot catch: anything outside the model (world.py's docstring says what) and
what needs more faults, crashes, moves, sessions or turns than these bounds allow (two
faults with a crash and a re-homing ran past 17 minutes and 9 GB here, unfinished)."""

from __future__ import annotations

import pytest

from protocol.lives import Step
from tests.protocol import redis_model
from tests.protocol.checker import Report, explore
from tests.protocol.world import Rules, Session, World

pytestmark = pytest.mark.long

# production's bound: every kind of fault, one of them per trace; each planted bug is
# explored at the smallest bound that shows it (two faults where it takes two)
BOUND = World(faults_left=1, crashes_left=1, moves_left=1, rehomes_left=1)
TWO_FAULTS = BOUND._replace(faults_left=2, crashes_left=0, rehomes_left=0)
# two sessions on one replica, sharing its lives, lease, fence, stream and re-homing
TWO_SESSIONS = BOUND._replace(sessions=(Session(turns_left=1), Session(turns_left=0)))


def with_turns(world: World, turns: int) -> World:
    """`world` with each session's client sending `turns` turns."""
    return world._replace(sessions=tuple(s._replace(turns_left=turns) for s in world.sessions))


def run(rules: Rules, start: World = BOUND, first_harm: bool = False) -> Report:
    report = explore(rules, start, first_harm=first_harm)
    turns = "+".join(str(s.turns_left) for s in start.sessions)
    sessions = "1 session" if len(start.sessions) == 1 else f"{len(start.sessions)} sessions"
    print(
        f"\nbound: 2 replicas, up to {start.crashes_left} crash and restart, "
        f"{sessions}, {start.moves_left} drain moves one at a time + "
        f"{start.rehomes_left} re-homing, {turns} turns, {start.faults_left} faults; "
        f"{report.states} states, {report.edges} transitions explored"
        + (
            ""
            if first_harm
            else f"; longest shortest settling schedule N = {report.depth}; {report.cycles} "
            "fault-free cycles, each left by every weakly fair schedule"
        )
    )
    if report.violations:
        print(report.first())
    return report


def test_production_keeps_every_turn_one_live_copy_and_always_settles():
    report = run(Rules())
    assert report.states > 200_000 and report.depth > 15  # it explored; settling takes work
    assert not report.violations, report.first()


def test_production_survives_two_faults_in_a_move():
    report = run(Rules(), TWO_FAULTS)
    assert report.states > 50_000 and report.depth > 10
    assert not report.violations, report.first()


def test_production_keeps_two_sessions_sharing_a_replica_apart():
    report = run(Rules(), TWO_SESSIONS)
    assert report.states > 300_000 and report.depth > 15
    assert not report.violations, report.first()


def found(report: Report, what: str) -> bool:
    return bool(report.violations) and what in report.violations[0][0]


def test_an_arrival_that_ignores_the_attempt_is_found():
    """Before nonces, a copy an undone attempt left on the target passed for the next
    attempt's arrival (an abort restores the same epoch): a later turn ran short, 200,
    no alarm."""
    rules = Rules(same_attempt=lambda copy, nonce: copy is not None)
    start = with_turns(TWO_FAULTS._replace(moves_left=2), 1)
    assert found(run(rules, start, first_harm=True), "missing from the history")


def test_a_settle_sent_once_is_found():
    """Before settles were retried and replicas settled their copies from the directory,
    a lost `migrate_cancel` left the source's copy leaving for good."""
    start = with_turns(TWO_FAULTS, 0)
    report = run(Rules(restores_undone=False, unlist_unanswered=True), start)
    assert found(report, "wedged")


def test_a_new_life_that_reads_the_directory_before_it_registers_is_found():
    """A restarted scheduler that took its sessions back before registering: a front
    that found it dead meanwhile re-homed them, and both copies served."""
    start = (Step.AWAIT_REHOMING, Step.READ_STREAM_END, Step.AWAIT_PROOF, Step.TAKE_BACK)
    rules = Rules(start=(*start, Step.REGISTER))
    assert found(run(rules, first_harm=True), "two live copies")


def test_a_store_and_a_scheduler_waiting_for_each_other_after_a_gap_are_found():
    """A new life that waited for the records proof before registering, while the store
    waited for a new life to decide the last one's gap: neither moved again."""
    waits = (Step.READ_STREAM_END, Step.AWAIT_PROOF, Step.REGISTER)
    rules = Rules(start=(*waits, Step.AWAIT_REHOMING, Step.TAKE_BACK), proof_blocks=True)
    start = BOUND._replace(faults_left=2, moves_left=0, rehomes_left=0)
    assert found(run(rules, start), "wedged")


def test_a_lease_renewed_while_its_holder_waits_is_found():
    """A registration sent before a pause renewing the lease from when it reached Redis
    (after the pause): the paused replica served on, while a front had re-homed its
    sessions."""
    rules = Rules(renew=lambda lease, sent: lease.renew(lease.clock()))
    assert found(run(rules, first_harm=True), "two live copies")


def test_a_compare_and_set_that_answers_its_own_retry_no_is_found():
    """redis-py sends a command again after a connection error: a begin whose swap's
    reply was lost ran it twice, heard "not swapped" from the second and unlisted its
    move, leaving the session in transit with no front to finish it."""

    def swap_once(key: str, value: str | None, old: str, new: str) -> redis_model.Outcome:
        return (value, 0, None) if value != old else (new, 1, f"{key} {new}")

    start = with_turns(BOUND._replace(crashes_left=0, rehomes_left=0), 0)
    assert found(run(Rules(swap=swap_once), start), "wedged")


def test_a_fence_that_minds_one_session_is_found():
    """A paused replica that lifted its fence once one session's copy was settled served
    the other's stale copy while a front re-homed it: a bug only two sessions show."""
    rules = Rules(fence_every_session=False)
    assert found(run(rules, TWO_SESSIONS, first_harm=True), "two live copies")


# a client closing its session while a front may drain it or re-home it
CLOSES = BOUND._replace(sessions=(Session(turns_left=0, closes_left=1),), crashes_left=0)


def test_production_never_answers_a_close_that_a_move_overtook():
    report = run(Rules(), CLOSES)
    assert report.states > 10_000 and report.depth > 10
    assert not report.violations, report.first()


def test_a_close_answered_after_its_session_moved_is_found():
    """A replica paused between closing a session and writing the close's record: a
    front re-homed the session from the store's record, which had no close, and the
    close, answered 200 once the replica woke, left the copy it went to living for a
    client that closed it (the fault campaign found its listing left behind)."""
    rules = Rules(close_stands=lambda copy, placed, replica: True, compare_on_close=False)
    assert found(run(rules, CLOSES, first_harm=True), "closed for its client")


def test_a_move_carried_from_the_records_of_a_source_that_still_serves_is_found():
    """A front that took a source missing its registration (a refused write, a short
    stall) as absent carried the move from the store's records, while the source, its
    lease still holding, went on serving its copy, never told: two live copies, and a
    turn it answered was missing from the copy the session moved to (the fault
    campaign's stale turn, 200, after a drain whose source stopped registering)."""
    rules = Rules(carries_from_records=lambda life: not life.registered)
    assert found(run(rules, first_harm=True), "two live copies")
