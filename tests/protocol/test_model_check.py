"""The session protocol explored exhaustively at a bound (tests/protocol/world.py,
checker.py): production's transitions (protocol/moves.py, copies.py, lives.py) hold
every safety property in every reachable state and can always settle; and bugs planted
as earlier builds decided them are each found, with the shortest trace printed.

The bound, printed by each run (`BOUND`): one session on two replicas, one of which may
crash and start a second life; a drain's front beginning one move; a second front taking
over moves whose lease ran out; a third, holding the duties, re-homing a replica it finds
dead (one move); two client turns; and one fault per trace, of any kind: a call's
request or reply lost, or the call delayed past later events; a front dying or stalling
past its lease; a client's turn delayed; a replica's life crashing or
pausing past its lease; a record lost from a replica's stream before the store applied
it. Production is also explored with two faults of the kinds a move meets, over one
move (`TWO_FAULTS`, no crash). What it cannot catch: anything outside the model
(world.py's docstring says what) and what needs more faults, crashes, moves or turns
than these bounds allow (two faults with a crash, or over two moves: that bound runs
for more than ten minutes)."""

from __future__ import annotations

from protocol.lives import Step
from tests.protocol import redis_model
from tests.protocol.checker import Report, explore
from tests.protocol.world import Rules, World

# production's bound: every kind of fault, one of them per trace; each planted bug is
# explored at the smallest bound that shows it (two faults where it takes two)
BOUND = World()._replace(faults_left=1, crashes_left=1, moves_left=1, rehomes_left=1)
TWO_FAULTS = BOUND._replace(faults_left=2, crashes_left=0, rehomes_left=0)


def run(rules: Rules, start: World = BOUND, first_harm: bool = False) -> Report:
    report = explore(rules, start, first_harm=first_harm)
    print(
        f"\nbound: 2 replicas, up to {start.crashes_left} crash and restart, 1 session, "
        f"{start.moves_left} drain moves one at a time + {start.rehomes_left} re-homing, "
        f"{start.turns_left} turns, {start.faults_left} faults; {report.states} states, "
        f"{report.edges} transitions explored"
        + ("" if first_harm else f"; longest shortest settling schedule N = {report.depth}")
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


def found(report: Report, what: str) -> bool:
    return bool(report.violations) and what in report.violations[0][0]


def test_an_arrival_that_ignores_the_attempt_is_found():
    """Before nonces, a copy an undone attempt left on the target passed for the next
    attempt's arrival (an abort restores the same epoch): a later turn ran short, 200,
    no alarm."""
    rules = Rules(same_attempt=lambda copy, nonce: copy is not None)
    start = TWO_FAULTS._replace(moves_left=2, turns_left=1)
    assert found(run(rules, start, first_harm=True), "missing from the history")


def test_a_settle_sent_once_is_found():
    """Before settles were retried and replicas settled their copies from the directory,
    a lost `migrate_cancel` left the source's copy leaving for good."""
    start = TWO_FAULTS._replace(turns_left=0)
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

    start = BOUND._replace(crashes_left=0, rehomes_left=0, turns_left=0)
    assert found(run(Rules(swap=swap_once), start), "wedged")
