"""Steps that do not run as planned (engine/faults.py) and memory pressure (engine/room.py):
no session is ever left on a slot nothing wrote, poison is quarantined, session state is
dropped only when that admits the waiting request, and expiry does not scan sessions."""

from __future__ import annotations

import numpy as np
import pytest

from services.scheduler.engine.faults import POISON_LOSSES
from services.scheduler.records.request import Status
from tests.engine.data_model import reference
from tests.engine.driver import VOCAB, Driver
from tests.engine.test_sessions import close_all, text


def history_of(d: Driver, sid: str) -> list[int]:
    return d.engine.sessions.sessions[sid].history.tolist()


@pytest.mark.parametrize("ops_ran", [False, True])
def test_a_refused_turn_leaves_its_session_on_written_state(ops_ran):
    """The refused step held the turn's rollback copy: whether or not that copy ran, the
    session's next turn starts from exactly its history's state (the data model checks
    every row's starting state) and equals one-shot."""
    d = Driver()
    sid = d.engine.sessions.open().sid
    d.run_turn(sid, text(9, 1), max_new=4)
    history = history_of(d, sid)
    turn = d.turn(sid, text(5, 2), max_new=4)
    plan = d.engine.plan_step()
    assert plan.ops.copies, "the turn's admission copies the session's state"
    if ops_ran:  # the executor applied the ops, then failed in the forward
        d.model.apply_ops(plan)
    ended = d.engine.step_refused(plan, "RuntimeError: forward failed", ops_ran=ops_ran)
    assert ended == [turn] and turn.status is Status.ABORTED
    assert history_of(d, sid) == history
    after = d.run_turn(sid, text(6, 3), max_new=4)
    assert after.output == reference(history + text(6, 3), 4, VOCAB)
    close_all(d)


def test_a_turn_aborted_with_its_copy_in_flight_survives_the_refusal_of_that_step():
    """Pipelined: the turn is aborted while the step holding its rollback copy is in
    flight (the session takes the copy's destination as its state), then that step is
    refused before its ops ran: the session must not keep the unwritten slot."""
    d = Driver()
    sid = d.engine.sessions.open().sid
    d.run_turn(sid, text(12, 1), max_new=4)
    history = history_of(d, sid)
    turn = d.turn(sid, text(5, 2), max_new=4)
    plan = d.engine.plan_step()
    d.engine.abort(turn.rid)
    assert d.engine.sessions.sessions[sid].slots is not None  # the copy, still unwritten
    d.engine.step_refused(plan, "Mamba slots [0] must lie in 1..64", ops_ran=False)
    after = d.run_turn(sid, text(4, 3), max_new=5)
    assert after.output == reference(history + text(4, 3), 5, VOCAB)
    d.assert_idle_clean()
    close_all(d)


def test_a_request_executing_at_two_executor_losses_is_quarantined():
    d = Driver()
    poison = d.generate(text(8, 1), max_new=6)
    other = d.generate(text(8, 2), max_new=6)
    for loss in range(1, POISON_LOSSES + 1):
        d.engine.plan_step()  # both run in the step the executor dies in
        ended = d.engine.device_lost()
        d.model = type(d.model)(d.pools, VOCAB, d._sequence)
        if loss < POISON_LOSSES:
            assert ended == [] and poison.status is Status.WAITING
    assert poison in ended and other in ended  # both were in the executing step twice
    assert "quarantined" in poison.finish_reason.message
    assert d.engine.quarantined == 2
    d.assert_idle_clean()


def test_a_loss_not_blamed_on_a_step_counts_against_no_request():
    d = Driver()
    req = d.generate(text(8, 1), max_new=6)
    for _ in range(POISON_LOSSES + 1):
        d.engine.plan_step()
        assert d.engine.device_lost(suspect=False) == []
        d.model = type(d.model)(d.pools, VOCAB, d._sequence)
    d.run()
    assert req.status is Status.FINISHED and req.output == reference(text(8, 1), 6, VOCAB)


def test_session_state_is_not_dropped_when_that_cannot_admit_the_request():
    """A request needing more KV than free + cache + every idle session could give waits,
    and every idle session keeps its state."""
    d = Driver(kv_pages=128, context=100, mamba_slots=16, rows=8, chunk=128)
    sids = [d.engine.sessions.open().sid for _ in range(2)]
    for i, sid in enumerate(sids):
        d.run_turn(sid, text(10, i + 1), max_new=4)
    hog = d.generate(text(40, 9), max_new=12)  # holds most of the pool while it runs
    d.step()
    d.step()
    waiting = d.generate(text(90, 8), max_new=2)  # cannot fit beside it, whatever drops
    d.step()
    assert waiting.status is Status.WAITING
    assert all(d.engine.sessions.sessions[s].slots is not None for s in sids)
    assert d.engine.sessions.states_dropped == 0
    d.run()
    assert hog.status is Status.FINISHED and waiting.status is Status.FINISHED
    close_all(d)


def test_a_cache_donation_never_takes_a_sessions_state():
    """With Mamba slots so short that the prefix cache could only take an entry by
    dropping an idle session's state, the entry is not taken."""
    d = Driver(mamba_slots=6, rows=4)  # one request holds 4, the session 1: 1 spare
    sid = d.engine.sessions.open().sid
    d.run_turn(sid, text(10, 1), max_new=3)
    d.generate(text(30, 2), max_new=3)
    d.run()
    assert d.engine.sessions.sessions[sid].slots is not None
    assert d.engine.sessions.states_dropped == 0
    close_all(d)


def test_session_expiry_looks_only_at_due_deadlines():
    """Counting work, not timing: with a thousand open sessions and none due, a step's
    expiry looks at no session; when one is due it looks at about one."""
    d = Driver()
    now = [0.0]
    sessions = d.engine.sessions
    sessions.clock = lambda: now[0]
    for i in range(1000):
        sessions.open(f"s{i}", timeout=100 + i)
    for _ in range(50):
        sessions.expire()
    assert sessions.deadlines.visits == 0
    now[0] = 100.5
    assert sessions.expire() == ["s0"]
    assert sessions.deadlines.visits == 1
    d.run_turn("s1", text(4, 1), max_new=2)  # used: its old deadline is stale
    now[0] = 101.5
    assert sessions.expire() == [] and sessions.deadlines.visits == 2
    now[0] = 250.0  # s2..s150 are due, and s1 at its new deadline (101.5 + 101)
    gone = sessions.expire()
    assert "s1" in gone and len(gone) == 150
    assert sessions.deadlines.visits == 2 + 150  # one entry per session, however used
    close_all(d)


def test_the_expiry_heap_holds_one_entry_per_session_however_many_turns():
    """A chatty session costs one entry (one per turn grew the heap without bound until
    the timeout); closed sessions' entries go with a rebuild."""
    d = Driver()
    sessions = d.engine.sessions
    sids = [sessions.open(timeout=3600).sid for _ in range(3)]
    for k in range(40):
        d.run_turn(sids[k % 3], text(2, k), max_new=1)
    assert len(sessions.deadlines) == 3
    many = [sessions.open(timeout=3600).sid for _ in range(200)]
    for sid in many:
        sessions.close(sid)
    assert len(sessions.deadlines) <= 2 * len(sessions.sessions) + 64
    close_all(d)


def test_a_long_turn_does_not_expire_and_its_session_expires_after_it():
    d = Driver()
    now = [0.0]
    d.engine.sessions.clock = lambda: now[0]
    sid = d.engine.sessions.open("busy", timeout=5).sid
    turn = d.turn(sid, np.arange(1, 8), max_new=6)
    d.step()
    now[0] = 50.0  # far past the deadline, but a turn is in flight
    d.run()
    assert turn.status is Status.FINISHED and sid in d.engine.sessions.sessions
    now[0] = 56.0
    assert d.engine.sessions.expire() == [sid]
